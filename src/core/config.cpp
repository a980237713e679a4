#include "teo/config.hpp"

#include "core/config_mla.hpp"
#include "core/config_moe.hpp"

#include "teo/suggest.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <optional>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

namespace teo {

namespace {

// User space on x86-64 and AArch64 Linux is 47 or 48 bits: no allocation can be larger, so sizes
// beyond it are rejected up front rather than left to fail (or abort) in the allocator.
constexpr index_t kAddressSpaceBytes = index_t{1} << 47;

std::optional<MemoryLimits>& limits_override() {
  static std::optional<MemoryLimits> l;
  return l;
}

index_t env_limit(const char* name, index_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 1) {
    throw ConfigError(std::string(name) + " must be a positive integer, got \"" + v + "\"");
  }
  return static_cast<index_t>(x);
}

index_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return kAddressSpaceBytes;
  return std::min<index_t>(kAddressSpaceBytes, static_cast<index_t>(pages) * page);
}

void check_tensor_elements(index_t n, const std::string& what, const MemoryLimits& l) {
  if (n > l.max_tensor_elements) {
    throw ShapeError(what + " would have " + std::to_string(n) +
                     " elements, more than the limit of " + std::to_string(l.max_tensor_elements) +
                     " (TEO_MAX_TENSOR_ELEMENTS)");
  }
}

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

void require_positive(const char* name, index_t v) {
  if (v <= 0) throw ConfigError(std::string(name) + " must be >= 1, got " + std::to_string(v));
}

bool finite_positive(double v) {
  return std::isfinite(v) && v > 0.0;
}

// The attention variants' keys (docs/semantics.md, "Attention variants").
void validate_variants(const ModelConfig& c) {
  if (c.attention.num_kv_heads) {
    const index_t kv = *c.attention.num_kv_heads;
    if (kv < 1 || kv > c.attention.num_heads || c.attention.num_heads % kv != 0) {
      throw ConfigError(
          "num_kv_heads must divide num_heads = " + std::to_string(c.attention.num_heads) +
          " (1 for multi-query attention), got " + std::to_string(kv));
    }
  }
  if (c.embeddings.position_offset < 0 || c.embeddings.position_offset > (index_t{1} << 40)) {
    throw ConfigError("position_offset must be in [0, 2^40], got " +
                      std::to_string(c.embeddings.position_offset));
  }
  if (c.attention.sliding_window && *c.attention.sliding_window < 1) {
    throw ConfigError("sliding_window must be >= 1 (or null for no window), got " +
                      std::to_string(*c.attention.sliding_window));
  }
  if (const auto& t = c.attention.layer_types; !t.empty()) {
    if (static_cast<index_t>(t.size()) != c.num_layers) {
      throw ConfigError(
          "layer_types has " + std::to_string(t.size()) +
          " entries: it needs one per layer, num_layers = " + std::to_string(c.num_layers));
    }
    if (!c.attention.sliding_window && std::ranges::find(t, LayerAttention::sliding) != t.end()) {
      throw ConfigError(
          "layer_types has \"sliding_attention\" layers, but sliding_window is null: set the "
          "window they attend through");
    }
  }
  if (c.attention.attn_logit_softcap && !finite_positive(*c.attention.attn_logit_softcap)) {
    throw ConfigError("attn_logit_softcap must be finite and > 0 (or null for no cap), got " +
                      fmt(*c.attention.attn_logit_softcap));
  }
  if (c.embeddings.positional == Positional::alibi) {
    if (!finite_positive(c.attention.alibi_max_bias)) {
      throw ConfigError("alibi_max_bias must be finite and > 0, got " +
                        fmt(c.attention.alibi_max_bias));
    }
  } else if (c.attention.alibi_max_bias != 8.0) {
    throw ConfigError("alibi_max_bias applies only to positional \"alibi\"");
  }
  const RopeScaling& sc = c.attention.rope_scaling;
  if (c.embeddings.positional != Positional::rope) {
    if (c.attention.rope_style != RopeStyle::neox || c.attention.rotary_dim ||
        c.attention.rope_base != 10000.0 || !(sc == RopeScaling{})) {
      throw ConfigError(
          "rope_style, rotary_dim, rope_base and rope_scaling apply only to positional \"rope\"");
    }
    return;
  }
  const index_t r = c.rotary();
  if (r < 0 || r % 2 != 0 || r > c.d_head()) {
    throw ConfigError("rotary_dim must be even and in [0, d_head = " + std::to_string(c.d_head()) +
                      "], got " + std::to_string(r));
  }
  if (!(std::isfinite(c.attention.rope_base) && c.attention.rope_base > 1.0)) {
    throw ConfigError("rope_base must be finite and > 1, got " + fmt(c.attention.rope_base));
  }
  if (sc.type == RopeScalingType::none) {
    if (!(sc == RopeScaling{})) {
      throw ConfigError("rope_scaling of type \"none\" takes no other key");
    }
    return;
  }
  if (!(std::isfinite(sc.factor) && sc.factor >= 1.0 && sc.factor <= 1e6)) {
    throw ConfigError("rope_scaling.factor must be in [1, 1e6], got " + fmt(sc.factor));
  }
  if (sc.original_max_len && *sc.original_max_len < 1) {
    throw ConfigError("rope_scaling.original_max_len must be >= 1, got " +
                      std::to_string(*sc.original_max_len));
  }
  if (sc.type == RopeScalingType::linear && sc.original_max_len) {
    throw ConfigError("rope_scaling.original_max_len applies only to ntk and yarn");
  }
  if (sc.type == RopeScalingType::ntk && r == 2) {
    throw ConfigError(
        "rope_scaling of type \"ntk\" needs rotary_dim > 2 (its exponent is r / (r - 2))");
  }
  if (sc.type == RopeScalingType::yarn) {
    // Rotations: YaRN's correction range divides the original context by 2 pi beta.
    if (!(sc.beta_fast > sc.beta_slow && sc.beta_slow >= 1e-3 && sc.beta_fast <= 1e6)) {
      throw ConfigError(
          "rope_scaling.beta_fast and beta_slow must satisfy 1e6 >= beta_fast > beta_slow >= "
          "1e-3, got " +
          fmt(sc.beta_fast) + " and " + fmt(sc.beta_slow));
    }
    for (const auto& [key, m] :
         {std::pair{"mscale", sc.mscale}, std::pair{"mscale_all_dim", sc.mscale_all_dim}}) {
      if (m && !finite_positive(*m)) {
        throw ConfigError(std::string("rope_scaling.") + key +
                          " must be finite and > 0 (or left out), got " + fmt(*m));
      }
    }
  } else if (sc.beta_fast != 32.0 || sc.beta_slow != 1.0 || !sc.truncate || sc.mscale ||
             sc.mscale_all_dim) {
    throw ConfigError(
        "rope_scaling.beta_fast, beta_slow, truncate, mscale and mscale_all_dim apply only to "
        "yarn");
  }
}

// input "patches" and its sizes (docs/semantics.md, section 18.5).
void validate_patches(const ModelConfig& c) {
  if (!c.patches_input()) {
    if (c.embeddings.image_size || c.embeddings.patch_size || c.embeddings.channels)
      throw ConfigError("image_size, patch_size and channels apply only to input \"patches\"");
    return;
  }
  if (!c.encoder()) {
    throw ConfigError(
        "input \"patches\" applies only to architecture \"encoder\" (ViT's classifier)");
  }
  for (const auto& [name, v] : {std::pair{"image_size", c.embeddings.image_size},
                                std::pair{"patch_size", c.embeddings.patch_size},
                                std::pair{"channels", c.embeddings.channels}}) {
    if (v == 0) throw ConfigError(std::string("input \"patches\" needs ") + name);
    require_positive(name, v);
  }
  if (c.embeddings.image_size % c.embeddings.patch_size != 0) {
    throw ConfigError("image_size " + std::to_string(c.embeddings.image_size) +
                      " must be a multiple of patch_size " +
                      std::to_string(c.embeddings.patch_size));
  }
  if (c.embeddings.image_size > (index_t{1} << 20) || c.embeddings.channels > (index_t{1} << 20)) {
    throw ConfigError("image_size and channels must be <= 2^20, got " +
                      std::to_string(c.embeddings.image_size) + " and " +
                      std::to_string(c.embeddings.channels));
  }
  if (c.embeddings.embed_scale || c.embeddings.type_vocab_size || c.embeddings.padding_idx ||
      c.embeddings.position_offset != 0) {
    throw ConfigError(
        "input \"patches\" has no token ids: embed_scale (true), type_vocab_size, padding_idx "
        "and position_offset do not apply");
  }
  if (c.embeddings.max_len != 1 + c.patches()) {
    throw ConfigError("with input \"patches\" the sequence is [CLS] and the " +
                      std::to_string(c.patches()) + " patches: max_len must be " +
                      std::to_string(1 + c.patches()) + " (or left out), got " +
                      std::to_string(c.embeddings.max_len));
  }
}

// The block variants' keys (docs/semantics.md, section 17.1).
void validate_block(const ModelConfig& c) {
  const Activation a = c.ffn.activation;
  if (c.ffn.kind == FfnKind::swiglu && a != Activation::gelu && a != Activation::silu) {
    throw ConfigError(std::string("ffn \"swiglu\" gates with silu: activation must be left out or "
                                  "\"silu\", got \"") +
                      to_string(a) + "\"");
  }
  if (c.decoder() && !c.attention.causal) {
    throw ConfigError(
        "a decoder's self-attention is causal: causal must be true (or left out) with architecture "
        "\"decoder\"");
  }
  if (c.lm() && (c.head.pooling != Pooling::mean || c.head.num_classes != 4)) {
    throw ConfigError(
        "pooling and num_classes apply only to architecture \"encoder\" (a decoder's head is its "
        "LM head over the vocabulary)");
  }
  if (c.head.tie_embeddings && !c.lm()) {
    throw ConfigError(
        "tie_embeddings applies only to architecture \"decoder\" or \"encoder_decoder\" (the LM "
        "head)");
  }
  if (!c.encoder() && (c.embeddings.type_vocab_size || c.embeddings.embedding_norm ||
                       c.head.pooler != Pooler::none)) {
    throw ConfigError(
        "type_vocab_size, embedding_norm and pooler apply only to architecture \"encoder\" (the "
        "BERT, RoBERTa and ViT embeddings and pooler)");
  }
  if (c.embeddings.padding_idx && (c.encoder_decoder() || *c.embeddings.padding_idx < 0 ||
                                   *c.embeddings.padding_idx >= c.embeddings.vocab_size)) {
    throw ConfigError("padding_idx must be a token id in [0, vocab_size = " +
                      std::to_string(c.embeddings.vocab_size) +
                      "), of an encoder or a decoder, got " +
                      std::to_string(*c.embeddings.padding_idx));
  }
  validate_patches(c);
  if (c.embeddings.type_vocab_size && *c.embeddings.type_vocab_size < 1) {
    throw ConfigError("type_vocab_size must be >= 1 (or left out for no token types), got " +
                      std::to_string(*c.embeddings.type_vocab_size));
  }
  if (!c.encoder_decoder() &&
      (c.decoder_layers || c.embeddings.decoder_vocab_size || c.embeddings.decoder_positional)) {
    throw ConfigError(
        "decoder_layers, decoder_vocab_size and decoder_positional apply only to architecture "
        "\"encoder_decoder\"");
  }
  if (c.encoder_decoder()) {
    if (c.decoder_layers && *c.decoder_layers < 0)
      throw ConfigError("decoder_layers must be >= 0, got " + std::to_string(*c.decoder_layers));
    if (c.embeddings.decoder_vocab_size && *c.embeddings.decoder_vocab_size < 1) {
      throw ConfigError("decoder_vocab_size must be >= 1, got " +
                        std::to_string(*c.embeddings.decoder_vocab_size));
    }
    // the decoder layer of section 17.4: no positions inside attention, no attention variants,
    // no dropout
    if (c.embeddings.positional == Positional::rope ||
        c.embeddings.positional == Positional::alibi) {
      throw ConfigError(std::string("an encoder_decoder's positions are added to the embeddings: "
                                    "positional must be sinusoidal, learned or none, got \"") +
                        to_string(c.embeddings.positional) + "\"");
    }
    if (c.attention.num_kv_heads || c.attention.sliding_window || c.attention.attn_logit_softcap ||
        c.attention.attn_sinks || c.attention.qk_norm || c.attention.head_dim ||
        !c.attention.layer_types.empty()) {
      throw ConfigError(
          "an encoder_decoder takes no attention variants (num_kv_heads, sliding_window, "
          "layer_types, attn_logit_softcap, attn_sinks, qk_norm, head_dim)");
    }
    if (c.dropout > 0) {
      throw ConfigError(
          "an encoder_decoder has no dropout: its decoder layer (semantics 17.4) "
          "runs without it; dropout must be 0");
    }
  }
  if (c.moe() && a != Activation::gelu && a != Activation::silu) {
    throw ConfigError(std::string("ffn \"moe\" gates with silu: activation must be left out or "
                                  "\"silu\", got \"") +
                      to_string(a) + "\"");
  }
  detail::validate_moe(c);
  if (c.ffn.kind == FfnKind::geglu && a != Activation::gelu && a != Activation::gelu_tanh) {
    throw ConfigError(std::string("ffn \"geglu\" gates with gelu: activation must be \"gelu\" or "
                                  "\"gelu_tanh\", got \"") +
                      to_string(a) + "\"");
  }
}

}  // namespace

void ModelConfig::validate() const {
  require_positive("vocab_size", embeddings.vocab_size);
  require_positive("max_len", embeddings.max_len);
  require_positive("d_model", d_model);
  require_positive("num_heads", attention.num_heads);
  require_positive("d_ff", ffn.d_ff);
  require_positive("num_classes", head.num_classes);
  if (num_layers < 0) {
    throw ConfigError("num_layers must be >= 0, got " + std::to_string(num_layers));
  }
  if (attention.head_dim) {
    // Dh apart from d_model: at most 2^20, and H * Dh as well (a product that cannot overflow)
    const index_t dh = *attention.head_dim;
    if (dh < 1 || dh > (index_t{1} << 20)) {
      throw ConfigError("head_dim must be in [1, 2^20] (or null for d_model / num_heads), got " +
                        std::to_string(dh));
    }
    if (attention.num_heads > (index_t{1} << 20) / dh) {
      throw ConfigError("num_heads x head_dim must be at most 2^20, got " +
                        std::to_string(attention.num_heads) + " x " + std::to_string(dh));
    }
  } else if (!attention.mla() && d_model % attention.num_heads != 0) {
    throw ConfigError("d_model must be divisible by num_heads (or head_dim set): d_model " +
                      std::to_string(d_model) + ", num_heads " +
                      std::to_string(attention.num_heads));
  }
  // eps is rounded to the dtype; below float's smallest normal it would vanish (or lose its
  // precision) in float32 and a constant row would give 0 * inf.
  if (!(norms.layer_norm_eps >= static_cast<double>(std::numeric_limits<float>::min())) ||
      !(norms.layer_norm_eps <= static_cast<double>(std::numeric_limits<float>::max()))) {
    throw ConfigError(
        "layer_norm_eps must be a normal float32 value in [1.1754943508222875e-38, "
        "3.4028234663852886e+38], got " +
        fmt(norms.layer_norm_eps));
  }
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    throw ConfigError("dropout must be in [0, 1), got " + fmt(dropout));
  }
  if (!(head.label_smoothing >= 0.0 && head.label_smoothing <= 1.0)) {
    throw ConfigError("label_smoothing must be in [0, 1], got " + fmt(head.label_smoothing));
  }
  // MLA's widths first: they make d_head() and rotary(), which the variants' checks read
  detail::validate_mla(*this);
  validate_variants(*this);
  validate_block(*this);
  // Every parameter tensor, and all of them together, must have an element and byte count that
  // fits in 64 bits (double is the widest dtype).
  const index_t d = d_model;
  // the token embedding (V, D), or the patch embedding (D, Ch, P, P) with its bias and [CLS]
  const index_t embed_weight =
      patches_input()
          ? checked_mul(
                checked_mul(checked_mul(embeddings.channels, embeddings.patch_size, "patch"),
                            embeddings.patch_size, "patch"),
                d, "patch_embedding.weight")
          : checked_mul(embeddings.vocab_size, d, "embedding.weight");
  const index_t embed =
      checked_add(embed_weight, patches_input() ? checked_mul(d, 2, "cls_token") : 0, "embedding");
  const index_t pos = checked_mul(embeddings.max_len, d, "pos_embedding.weight");
  // q, k, v and o bounded by four (D, max(D, H * Dh)) matrices, their biases by 8 max(D, H * Dh)
  const index_t aw = std::max(d, attn_width());
  const index_t attn =
      checked_add(checked_mul(checked_mul(d, aw, "attn weight"), 4, "attn weights"),
                  checked_mul(aw, 8, "attn and norm biases"), "attention");
  // a gated FFN's three weights (and biases) bound a plain one's two
  const index_t ffn_params =
      checked_add(checked_mul(checked_mul(ffn.d_ff, d, "ffn weight"), 3, "ffn weights"),
                  checked_add(checked_mul(ffn.d_ff, 2, "ffn biases"), d, "ffn biases"), "ffn");
  index_t layers = checked_mul(checked_add(attn, ffn_params, "layer"), num_layers, "all layers");
  // an encoder-decoder's decoder: two attention blocks, its embeddings and a second final norm
  index_t decoder_extra = 0;
  if (encoder_decoder()) {
    decoder_extra = checked_add(
        checked_mul(checked_add(checked_mul(attn, 2, "decoder layer"), ffn_params, "decoder layer"),
                    dec_layers(), "decoder layers"),
        checked_add(
            checked_add(embeddings.decoder_vocab_size ? checked_mul(*embeddings.decoder_vocab_size,
                                                                    d, "decoder.embedding.weight")
                                                      : 0,
                        pos, "decoder embeddings"),
            checked_mul(d, 2, "decoder.final_norm"), "decoder embeddings"),
        "decoder");
    layers = checked_add(layers, decoder_extra, "all layers");
  }
  // the head: the classifier's (C, D) and (C), or an LM head, (Vt, D) unless tied, (Vt)
  const index_t head_params =
      lm() ? checked_add(head.tie_embeddings ? 0 : checked_mul(target_vocab(), d, "lm_head.weight"),
                         head.head_bias ? target_vocab() : 0, "lm_head")
           : checked_add(checked_mul(head.num_classes, d, "head.weight"), head.num_classes, "head");
  // token types (Tv, D), the embedding norm (2 D) and the pooler (D, D) + (D)
  const index_t types = embeddings.type_vocab_size ? checked_mul(*embeddings.type_vocab_size, d,
                                                                 "token_type_embedding.weight")
                                                   : 0;
  const index_t extra = checked_add(
      checked_add(types, checked_mul(d, 2, "embedding_norm"), "embedding extras"),
      head.pooler == Pooler::none ? 0
                                  : checked_add(checked_mul(d, d, "pooler.weight"), d, "pooler"),
      "embedding extras");
  const index_t total = checked_add(
      checked_add(
          checked_add(checked_add(checked_add(embed, pos, "embeddings"), extra, "embeddings"),
                      checked_add(layers, head_params, "layers + head"), "parameters"),
          checked_mul(d, 2, "final_norm"), "parameters"),
      checked_add(detail::moe_param_count(*this), detail::mla_param_count(*this), "parameters"),
      "parameters");
  const MemoryLimits lim = memory_limits();
  check_tensor_elements(embed_weight,
                        patches_input() ? "patch_embedding.weight" : "embedding.weight", lim);
  check_tensor_elements(pos, "pos_embedding.weight", lim);
  check_tensor_elements(types, "token_type_embedding.weight", lim);
  check_tensor_elements(checked_mul(ffn.d_ff, d, "ffn weight"), "ffn.fc1.weight", lim);
  check_tensor_elements(checked_mul(d, d, "attn weight"), "attn.q.weight", lim);
  check_tensor_elements(checked_mul(head.num_classes, d, "head.weight"), "head.weight", lim);
  const index_t param_bytes =
      checked_mul(total, static_cast<index_t>(sizeof(double)), "parameter bytes");
  if (param_bytes > lim.max_total_bytes) {
    throw ShapeError("the parameters need " + std::to_string(param_bytes) +
                     " bytes in float64, more than the limit of " +
                     std::to_string(lim.max_total_bytes) + " bytes (TEO_MAX_BYTES)");
  }
  if (param_bytes > kAddressSpaceBytes) {
    throw ShapeError("the parameters need " + std::to_string(param_bytes) +
                     " bytes in float64, more than a 47-bit address space (" +
                     std::to_string(kAddressSpaceBytes) + " bytes) can hold");
  }
}

void validate_batch_shape(const ModelConfig& cfg, const BatchShape& shape, std::size_t real_size) {
  BatchShape s = shape;
  if (cfg.encoder_decoder()) {
    // The decoder's side: its own length within max_len; every bound below then takes the longer
    // of the two sequences and the decoder's layers (two attentions each) on top of the encoder's.
    if (s.tgt_len < 1) throw ShapeError("tgt_len must be >= 1, got " + std::to_string(s.tgt_len));
    if (s.tgt_len > cfg.embeddings.max_len) {
      throw ShapeError("tgt_len " + std::to_string(s.tgt_len) + " exceeds max_len " +
                       std::to_string(cfg.embeddings.max_len));
    }
    if (cfg.dec_positional() == Positional::learned &&
        cfg.embeddings.position_offset > cfg.embeddings.max_len - s.tgt_len) {
      throw ShapeError("position_offset " + std::to_string(cfg.embeddings.position_offset) +
                       " + tgt_len " + std::to_string(s.tgt_len) + " exceeds max_len " +
                       std::to_string(cfg.embeddings.max_len) + ", the learned table's rows");
    }
  } else if (s.tgt_len != 0) {
    throw ShapeError("tgt_len applies only to architecture \"encoder_decoder\"");
  }
  if (s.batch < 0) throw ShapeError("batch must be >= 0, got " + std::to_string(s.batch));
  if (s.seq_len < 1) throw ShapeError("seq_len must be >= 1, got " + std::to_string(s.seq_len));
  if (s.seq_len > cfg.embeddings.max_len) {
    throw ShapeError("seq_len " + std::to_string(s.seq_len) + " exceeds max_len " +
                     std::to_string(cfg.embeddings.max_len));
  }
  if (cfg.embeddings.positional == Positional::learned &&
      cfg.embeddings.position_offset > cfg.embeddings.max_len - s.seq_len) {
    throw ShapeError("position_offset " + std::to_string(cfg.embeddings.position_offset) +
                     " + seq_len " + std::to_string(s.seq_len) + " exceeds max_len " +
                     std::to_string(cfg.embeddings.max_len) + ", the learned table's rows");
  }
  const auto bytes = static_cast<index_t>(real_size);
  const index_t longest = std::max(s.seq_len, s.tgt_len);
  const index_t tokens = checked_mul(s.batch, longest, "batch x seq_len");
  checked_mul(checked_mul(tokens, cfg.d_model, "batch x seq_len x d_model"), bytes,
              "batch x seq_len x d_model bytes");
  checked_mul(checked_mul(tokens, cfg.ffn.d_ff, "batch x seq_len x d_ff"), bytes,
              "batch x seq_len x d_ff bytes");
  const index_t scores =
      checked_mul(checked_mul(tokens, cfg.attention.num_heads, "batch x heads x seq_len"), longest,
                  "batch x heads x seq_len x seq_len");
  checked_mul(scores, bytes, "attention scores bytes");
  checked_mul(checked_mul(s.batch, cfg.head.num_classes, "batch x num_classes"), bytes,
              "logits bytes");
  const MemoryLimits lim = memory_limits();
  check_tensor_elements(checked_mul(tokens, cfg.d_model, "act"),
                        "a (batch, seq_len, d_model) activation", lim);
  check_tensor_elements(checked_mul(tokens, cfg.ffn.d_ff, "act"),
                        "a (batch, seq_len, d_ff) activation", lim);
  check_tensor_elements(scores, "a (batch, heads, seq_len, seq_len) activation", lim);
  // a decoder's LM logits and their softmax, (B, S, V) each
  const index_t lm =
      cfg.lm() ? checked_mul(checked_mul(s.batch, cfg.encoder_decoder() ? s.tgt_len : s.seq_len,
                                         "batch x seq_len"),
                             cfg.target_vocab(), "batch x seq_len x vocab")
               : 0;
  check_tensor_elements(lm, "a (batch, seq_len, vocab_size) activation", lim);
  // Everything the forward keeps, all layers together: a loose upper bound of 16 (B,S,D)-sized,
  // 5 (B,S,F)-sized and 3 (B,H,S,S)-sized buffers per layer, and the LM logits.
  const index_t per_layer = [&] {
    index_t a = checked_mul(checked_mul(tokens, cfg.d_model, "act"), 16, "layer activations");
    index_t b = checked_mul(checked_mul(tokens, cfg.ffn.d_ff, "act"), 5, "layer activations");
    index_t c = checked_mul(scores, 3, "layer activations");
    if (a > INT64_MAX - b || a + b > INT64_MAX - c)
      throw ShapeError("layer activations overflow 64 bits");
    return checked_add(
        checked_add(a + b + c, detail::moe_activation_values(cfg, tokens), "layer activations"),
        detail::mla_activation_values(cfg, tokens), "layer activations");
  }();
  // images: the pixels (B, Ch, Img, Img), held as double in the batch, and in Real twice more
  // while the patch embedding runs (the pixels and their patches, one row each)
  const index_t pixels =
      cfg.patches_input()
          ? checked_mul(
                checked_mul(s.batch, cfg.embeddings.channels, "batch x channels"),
                checked_mul(cfg.embeddings.image_size, cfg.embeddings.image_size, "image pixels"),
                "input.pixels")
          : 0;
  check_tensor_elements(pixels, "input.pixels", lim);
  const index_t pixel_bytes =
      checked_mul(pixels, checked_add(8, checked_mul(bytes, 2, "pixel bytes"), "pixel bytes"),
                  "input.pixels bytes");
  const index_t act_bytes = checked_add(
      pixel_bytes,
      checked_mul(
          checked_add(
              checked_mul(per_layer,
                          checked_add(checked_add(cfg.num_layers, 1, "num_layers + 1"),
                                      cfg.encoder_decoder()
                                          ? checked_mul(cfg.dec_layers(), 2, "decoder layers")
                                          : 0,
                                      "layers"),
                          "all activations"),
              checked_mul(lm, 2, "LM logits"), "all activations"),
          bytes, "all activation bytes"),
      "all activation bytes");
  if (act_bytes > kAddressSpaceBytes) {
    throw ShapeError("batch " + std::to_string(s.batch) + " x seq_len " +
                     std::to_string(s.seq_len) + " needs about " + std::to_string(act_bytes) +
                     " bytes of activations, more than a 47-bit address space can hold");
  }
  if (act_bytes > lim.max_total_bytes) {
    throw ShapeError("batch " + std::to_string(s.batch) + " x seq_len " +
                     std::to_string(s.seq_len) + " needs up to " + std::to_string(act_bytes) +
                     " bytes of activations, more than the limit of " +
                     std::to_string(lim.max_total_bytes) + " bytes (TEO_MAX_BYTES)");
  }
}

MemoryLimits memory_limits() {
  if (limits_override()) return *limits_override();
  MemoryLimits l;
  l.max_tensor_elements = env_limit("TEO_MAX_TENSOR_ELEMENTS", l.max_tensor_elements);
  l.max_total_bytes = env_limit("TEO_MAX_BYTES", physical_memory_bytes());
  return l;
}

void set_memory_limits(const MemoryLimits& l) {
  if (l.max_tensor_elements < 1 || l.max_total_bytes < 1) {
    throw ConfigError("memory limits must be >= 1, got max_tensor_elements " +
                      std::to_string(l.max_tensor_elements) + ", max_total_bytes " +
                      std::to_string(l.max_total_bytes));
  }
  limits_override() = l;
}

}  // namespace teo
