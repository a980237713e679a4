// ModelConfig's multi-head latent attention keys (include/teo/config.hpp, AttentionConfig):
// JSON, validation and sizes (docs/semantics.md, 14.12).
#include "core/config_mla.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/json_get.hpp"

namespace teo::detail {

namespace {

constexpr index_t kMaxWidth = index_t{1} << 20;

void require_width(const char* key, index_t v, index_t least) {
  if (v < least || v > kMaxWidth) {
    throw ConfigError(std::string(key) + " must be in [" + std::to_string(least) +
                      ", 2^20] with kv_lora_rank set, got " + std::to_string(v));
  }
}

}  // namespace

const std::vector<std::string>& mla_keys() {
  static const std::vector<std::string> k = {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                             "qk_rope_head_dim", "v_head_dim"};
  return k;
}

bool read_mla_key(AttentionConfig& a, const std::string& key, const nlohmann::json& v) {
  const auto optional = [&](std::optional<index_t>& f) {
    if (v.is_null())
      f.reset();
    else
      f = get_int(v, key);
  };
  if (key == "kv_lora_rank") {
    optional(a.kv_lora_rank);
  } else if (key == "q_lora_rank") {
    optional(a.q_lora_rank);
  } else if (key == "qk_nope_head_dim") {
    a.qk_nope_head_dim = get_int(v, key);
  } else if (key == "qk_rope_head_dim") {
    a.qk_rope_head_dim = get_int(v, key);
  } else if (key == "v_head_dim") {
    a.v_head_dim = get_int(v, key);
  } else {
    return false;
  }
  return true;
}

void mla_to_json(const ModelConfig& c, nlohmann::json& j) {
  const AttentionConfig& a = c.attention;
  if (!a.mla()) return;
  j["kv_lora_rank"] = *a.kv_lora_rank;
  if (a.q_lora_rank) j["q_lora_rank"] = *a.q_lora_rank;
  j["qk_nope_head_dim"] = a.qk_nope_head_dim;
  j["qk_rope_head_dim"] = a.qk_rope_head_dim;
  j["v_head_dim"] = a.v_head_dim;
}

void validate_mla(const ModelConfig& c) {
  const AttentionConfig& a = c.attention;
  if (!a.mla()) {
    if (a.q_lora_rank || a.qk_nope_head_dim != 0 || a.qk_rope_head_dim != 0 || a.v_head_dim != 0) {
      throw ConfigError(
          "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim are multi-head latent "
          "attention's: they need kv_lora_rank");
    }
    return;
  }
  require_width("kv_lora_rank", *a.kv_lora_rank, 1);
  if (a.q_lora_rank) require_width("q_lora_rank", *a.q_lora_rank, 1);
  require_width("qk_nope_head_dim", a.qk_nope_head_dim, 0);
  require_width("qk_rope_head_dim", a.qk_rope_head_dim, 2);
  require_width("v_head_dim", a.v_head_dim, 1);
  if (a.qk_rope_head_dim % 2 != 0) {
    throw ConfigError("qk_rope_head_dim must be even (RoPE rotates pairs), got " +
                      std::to_string(a.qk_rope_head_dim));
  }
  const index_t widest = std::max(a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim);
  if (a.num_heads > kMaxWidth / widest) {
    throw ConfigError(
        "num_heads x (qk_nope_head_dim + qk_rope_head_dim) and num_heads x "
        "v_head_dim must be at most 2^20, got " +
        std::to_string(a.num_heads) + " x " + std::to_string(widest));
  }
  if (c.embeddings.positional != Positional::rope) {
    throw ConfigError(std::string("multi-head latent attention (kv_lora_rank) rotates its RoPE "
                                  "key: positional must be \"rope\", got \"") +
                      to_string(c.embeddings.positional) + "\"");
  }
  if (c.encoder_decoder()) {
    throw ConfigError(
        "multi-head latent attention (kv_lora_rank) runs in architectures \"encoder\" and "
        "\"decoder\"; an encoder_decoder's decoder layers do not take it");
  }
  if (a.head_dim || a.rotary_dim) {
    throw ConfigError(
        "with kv_lora_rank the head widths are qk_nope_head_dim, qk_rope_head_dim and "
        "v_head_dim: head_dim and rotary_dim must be left out");
  }
  if (a.num_kv_heads && *a.num_kv_heads != a.num_heads) {
    throw ConfigError(
        "with kv_lora_rank every head has its own k and v (expanded from the "
        "latent): num_kv_heads must be left out or num_heads, got " +
        std::to_string(*a.num_kv_heads));
  }
  if (a.qk_norm) throw ConfigError("qk_norm does not combine with kv_lora_rank");
  if (a.attn_bias || a.out_bias()) {
    throw ConfigError(
        "multi-head latent attention's projections have no biases (DeepSeek's attention_bias "
        "false): attn_bias must be false");
  }
}

index_t mla_param_count(const ModelConfig& c) {
  const AttentionConfig& a = c.attention;
  if (!a.mla()) return 0;
  const index_t D = c.d_model, H = a.num_heads, Rkv = *a.kv_lora_rank;
  const index_t Dr = a.qk_rope_head_dim, Dq = c.attn_width();
  // q_a, its norm and q_b (or q), kv_a, its norm, kv_b and o
  index_t q = checked_mul(Dq, D, "attn.q.weight");
  if (a.q_lora_rank) {
    const index_t Rq = *a.q_lora_rank;
    q = checked_add(checked_mul(checked_add(D, Dq, "q latent"), Rq, "attn.q_b.weight"), Rq,
                    "q latent");
  }
  const index_t kv_a = checked_mul(checked_add(Rkv, Dr, "kv_a"), D, "attn.kv_a.weight");
  const index_t kv_b =
      checked_mul(checked_mul(H, checked_add(a.qk_nope_head_dim, a.v_head_dim, "kv_b"), "kv_b"),
                  Rkv, "attn.kv_b.weight");
  const index_t o = checked_mul(D, c.context_width(), "attn.o.weight");
  // each tensor within the element limit, as the experts' are (config_moe.cpp)
  const MemoryLimits lim = memory_limits();
  const index_t q_b = checked_mul(Dq, a.q_lora_rank.value_or(D), "attn.q_b.weight");
  for (const auto& [n, count] :
       {std::pair{"attn.q_b.weight (attn.q.weight)", q_b}, std::pair{"attn.kv_a.weight", kv_a},
        std::pair{"attn.kv_b.weight", kv_b}, std::pair{"attn.o.weight", o}}) {
    if (count > lim.max_tensor_elements) {
      throw ShapeError(std::string(n) + " would have " + std::to_string(count) +
                       " elements, more than the limit of " +
                       std::to_string(lim.max_tensor_elements) + " (TEO_MAX_TENSOR_ELEMENTS)");
    }
  }
  const index_t layer = checked_add(
      checked_add(checked_add(q, kv_a, "mla"), checked_add(kv_b, o, "mla"), "mla"), Rkv, "mla");
  return checked_mul(layer, c.num_layers, "all mla layers");
}

index_t mla_activation_values(const ModelConfig& c, index_t tokens) {
  const AttentionConfig& a = c.attention;
  if (!a.mla()) return 0;
  // q_a and its norm, kv_a and its norm, and the head-wide q, k, v, q_rot, k_rot and context
  // with the passes' transient (N, H (Dn + Dv)) products, which the D-wide bound does not cover
  // when H Dh exceeds D: per token at most 2 Rq + 2 (Rkv + Dr) + 8 H max(Dh, Dn + Dv)
  const index_t Rq = a.q_lora_rank.value_or(0), Rkv = *a.kv_lora_rank;
  const index_t wide =
      a.num_heads * std::max(c.d_head(), a.qk_nope_head_dim + a.v_head_dim);  // <= 2^21
  const index_t per_token =
      checked_add(checked_mul(checked_add(Rq, Rkv + a.qk_rope_head_dim, "mla"), 2, "mla"),
                  checked_mul(wide, 8, "mla"), "mla");
  const index_t head_wide = checked_mul(tokens, wide, "batch x seq_len x heads x head width");
  const MemoryLimits lim = memory_limits();
  if (head_wide > lim.max_tensor_elements) {
    throw ShapeError(
        "a (batch, seq_len, heads x head width) activation of latent attention "
        "would have " +
        std::to_string(head_wide) + " elements, more than the limit of " +
        std::to_string(lim.max_tensor_elements) + " (TEO_MAX_TENSOR_ELEMENTS)");
  }
  return checked_mul(tokens, per_token, "mla activations");
}

}  // namespace teo::detail
