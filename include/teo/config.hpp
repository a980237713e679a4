// ModelConfig: the model's hyper-parameters, with JSON I/O and validation.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "teo/errors.hpp"
#include "teo/moe_kinds.hpp"
#include "teo/weight_format.hpp"

namespace teo {

// sinusoidal and learned are added to the embeddings; rope rotates q and k; alibi biases the
// scores; none has no position signal (docs/semantics.md, "Positions").
enum class Positional { sinusoidal, learned, none, rope, alibi };
enum class Pooling { mean, cls, max };
// Which dimensions RoPE rotates together: neox pairs (i, i + r/2), interleaved pairs (2i, 2i + 1).
enum class RopeStyle { neox, interleaved };
enum class RopeScalingType { none, linear, ntk, yarn };
// What the model is: an encoder with a pooled classifier head (the default), or a decoder-only
// language model (causal self-attention, an LM head over the vocabulary, next-token loss).
enum class Architecture { encoder, decoder, encoder_decoder };
// The layers' norm: LayerNorm (mean and variance, weight and bias) or RMSNorm (no mean, no bias).
enum class Norm { layernorm, rmsnorm };
// The feed-forward network: fc2(act(fc1(x))), or gated, fc2(act(gate(x)) * fc1(x)) with act silu
// (swiglu) or gelu (geglu); or a mixture of experts (moe: ffn.moe, its dense layers swiglu).
enum class FfnKind { mlp, swiglu, geglu, moe };
// What the classifier head reads: the pooled vector itself, or BERT's pooler over it,
// tanh(pooled W^T + b).
enum class Pooler { none, dense_tanh };
// What the encoder reads: token ids, or an image cut into patches (ViT: a strided convolution's
// linear map of each patch, a learned [CLS] token prepended; semantics 18.5).
enum class InputKind { tokens, patches };
// A layer's attention under layer_types (gpt-oss): through the sliding window, or over every key.
enum class LayerAttention { sliding, full };

const char* to_string(Activation a);
const char* to_string(Positional p);
const char* to_string(Pooling p);
const char* to_string(RopeStyle s);
const char* to_string(RopeScalingType t);
const char* to_string(Architecture a);
const char* to_string(Norm n);
const char* to_string(FfnKind f);
const char* to_string(Pooler p);
const char* to_string(InputKind k);
const char* to_string(LayerAttention a);  // "sliding_attention", "full_attention"

// RoPE's context-extension scaling, with Hugging Face's formulas (docs/semantics.md, "RoPE").
struct RopeScaling {
  RopeScalingType type = RopeScalingType::none;
  double factor = 1.0;
  std::optional<index_t> original_max_len{};  // unset: max_len
  double beta_fast = 32.0;                    // yarn only
  double beta_slow = 1.0;                     // yarn only
  // yarn only: the correction range rounded outwards to whole dimensions (Hugging Face's
  // default); false keeps it fractional (gpt-oss's "truncate": false)
  bool truncate = true;
  // yarn only (DeepSeek-V2/V3): the attention factor on cos and sin is m(mscale) /
  // m(mscale_all_dim) with m(a) = 0.1 a ln(factor) + 1 when both are set (else m(1)), and
  // mscale_all_dim also multiplies the score scale by m(mscale_all_dim)^2 (semantics 14.12)
  std::optional<double> mscale{};
  std::optional<double> mscale_all_dim{};

  bool operator==(const RopeScaling&) const = default;
};

// The model's hyper-parameters in the sections the model has. Every field is named as its JSON
// key (docs/semantics.md section 2), except ffn.kind, whose key is "ffn"; the JSON is flat.

// What the model reads and how positions enter it.
struct EmbeddingsConfig {
  index_t vocab_size = 64;
  index_t max_len = 32;
  Positional positional = Positional::sinusoidal;
  bool embed_scale = false;     // multiply token embeddings by sqrt(d_model)
  index_t position_offset = 0;  // positions run from here to here + S - 1
  // Real encoders' embeddings (docs/semantics.md, section 18); architecture "encoder" only.
  // Token-type (segment) embeddings over type_vocab_size types (unset: none), added to the token
  // and position embeddings; a norm (of norms.norm's kind) over that sum before the input dropout.
  std::optional<index_t> type_vocab_size{};
  bool embedding_norm = false;
  // The token whose embedding row gets no gradient from the lookup (nn.Embedding's padding_idx,
  // BERT's and RoBERTa's pad token; semantics 18.1); an encoder's or a decoder's. Unset: none.
  std::optional<index_t> padding_idx{};
  // encoder_decoder only (docs/semantics.md, section 17.5): the decoder's vocabulary (unset: the
  // encoder's, whose embedding matrix it then shares; set: its own decoder.embedding) and its
  // positions (sinusoidal, learned or none; unset: positional).
  std::optional<index_t> decoder_vocab_size{};
  std::optional<Positional> decoder_positional{};
  // input "patches" (architecture "encoder" only): images (B, channels, image_size, image_size),
  // cut into (image_size / patch_size)^2 patches of patch_size^2 pixels per channel. The sequence
  // is the [CLS] token and the patches, 1 + patches() positions, and max_len is that length.
  // There are no token ids: vocab_size, embed_scale, type_vocab_size, padding_idx and
  // position_offset do not apply. 0 with input "tokens".
  InputKind input = InputKind::tokens;
  index_t image_size = 0;
  index_t patch_size = 0;
  index_t channels = 0;

  bool operator==(const EmbeddingsConfig&) const = default;
};

// Attention and its variants (docs/semantics.md, "Attention variants"); the defaults are the plain
// layer.
struct AttentionConfig {
  index_t num_heads = 2;
  bool causal = false;
  std::optional<index_t> num_kv_heads{};  // unset: num_heads; must divide it (1: MQA)
  // Dh, each head's width (semantics 14.10); unset: d_model / num_heads. Set, q and the context
  // are H * Dh wide, which need not be d_model (Qwen3-MoE: D 2048, 32 heads of 128; gpt-oss: 2880).
  std::optional<index_t> head_dim{};
  RopeStyle rope_style = RopeStyle::neox;   // rope only
  std::optional<index_t> rotary_dim{};      // rope only; unset: d_head
  double rope_base = 10000.0;               // rope only
  RopeScaling rope_scaling{};               // rope only
  double alibi_max_bias = 8.0;              // alibi only
  std::optional<index_t> sliding_window{};  // W: each query sees W keys (counting itself)
  // Each layer's attention (Hugging Face's layer_types, gpt-oss's alternation): layer i is
  // windowed when layer_types[i] is sliding and sees every key when it is full; empty, every layer
  // is windowed by sliding_window when it is set (semantics 14.5).
  std::vector<LayerAttention> layer_types{};
  std::optional<double> attn_logit_softcap{};  // c: logits c tanh(s / c)
  bool attn_sinks = false;                     // a learned sink logit per head
  // q and k RMS-normalised per head over Dh before RoPE, each with a weight (Dh) of its own
  // (Qwen3's q_norm and k_norm; docs/semantics.md, 14.11)
  bool qk_norm = false;
  bool attn_bias = true;  // the q, k, v and output projections have biases
  // Multi-head latent attention (DeepSeek-V2/V3; docs/semantics.md, 14.12), set by kv_lora_rank:
  // k and v are expanded from a normalised latent of kv_lora_rank (Rkv) per token, which also
  // carries one shared RoPE key of qk_rope_head_dim (Dr); q from a latent of q_lora_rank (Rq),
  // or from x when that is unset. Each head's q and k are qk_nope_head_dim (Dn) + Dr wide, its v
  // v_head_dim (Dv); RoPE rotates the last Dr of each.
  std::optional<index_t> kv_lora_rank{};
  std::optional<index_t> q_lora_rank{};
  index_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool mla() const { return kv_lora_rank.has_value(); }
  // The output projections' bias alone (Qwen2's attention: q, k and v biases, none on o); unset:
  // attn_bias.
  std::optional<bool> attn_out_bias{};
  bool out_bias() const { return attn_out_bias.value_or(attn_bias); }

  bool operator==(const AttentionConfig&) const = default;
};

// A mixture of experts in place of the FFN (ffn "moe"; docs/semantics.md, section 19). The keys
// are the moe op's (docs/golden-format.md): the router's, the routed experts', the shared
// experts', which layers are MoE layers, and the training loss's router terms.
struct MoeConfig {
  // the router (teo/layers/moe_router.hpp; teo::moe_spec makes the block's spec of these keys)
  index_t num_experts = 0;  // E; at least 1 with ffn "moe"
  index_t num_experts_per_tok = 1;
  RouterScoring router_scoring = RouterScoring::softmax;
  RouterOrder router_order = RouterOrder::score_then_topk;
  index_t router_groups = 1, topk_groups = 1;  // the group keys are written with groups > 1
  GroupScore group_score = GroupScore::top2_sum;
  bool norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  bool router_bias = false;     // moe.gate.bias (gpt-oss)
  bool selection_bias = false;  // moe.gate.e_score_correction_bias (DeepSeek-V3)
  // the routed experts
  index_t moe_d_ff = 0;  // each expert's width; at least 1 with ffn "moe"
  ExpertKind expert_kind = ExpertKind::swiglu;
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;  // clamped_swiglu only
  bool expert_bias = false;
  bool weight_at_input = false;  // JSON weight_at: "output" (false) or "input" (Llama 4)
  // the shared experts: one SwiGLU MLP of this total width (0: none), always applied, times
  // Qwen2-MoE's sigmoid gate with shared_expert_gate
  index_t shared_d_ff = 0;
  bool shared_expert_gate = false;
  // Layer i is an MoE layer when i >= first_dense_layers and (i + 1) % moe_every == 0; the others
  // are dense, a SwiGLU FFN of d_ff.
  index_t first_dense_layers = 0;
  index_t moe_every = 1;
  // The training loss adds aux_coef times the load-balancing loss and z_coef times the router
  // z-loss, each over every MoE layer's real tokens at once (Hugging Face's concatenation).
  double router_aux_loss_coef = 0.0;
  double router_z_loss_coef = 0.0;

  bool operator==(const MoeConfig&) const = default;
};

// The feed-forward network (docs/semantics.md, section 17.1).
struct FfnConfig {
  FfnKind kind = FfnKind::mlp;  // JSON key "ffn"
  index_t d_ff = 32;
  Activation activation = Activation::gelu;
  bool ffn_bias = true;  // the FFN's linear maps have biases
  MoeConfig moe{};       // ffn "moe" only; its keys are flat, as every other

  bool operator==(const FfnConfig&) const = default;
};

// The norms: their kind, epsilon and place.
struct NormsConfig {
  Norm norm = Norm::layernorm;  // every norm of the model, final_norm included
  double layer_norm_eps = 1e-5;
  bool norm_first = false;  // false: post-norm (the original paper); true: pre-norm + final_norm

  bool operator==(const NormsConfig&) const = default;
};

// Quantized weights (docs/quantization.md, "Quantized models"): the layers' linear weights stored
// in `format` as checkpoints ship them. The golden's values of such a weight are its exact
// dequantized values; it has no gradient.
struct QuantizationConfig {
  quant::WeightFormat format;  // never dense
  // Which parameters: globs over teo's parameter names ("layers.*.moe.experts.*"); empty: every
  // linear weight of the layers (attention, FFN, experts, shared experts), not the router's, the
  // embeddings', the norms' or the head's.
  std::vector<std::string> targets;
  bool operator==(const QuantizationConfig&) const = default;
};

// What reads the last hidden state: an encoder's pooling, pooler and classifier, or an LM head;
// and the loss.
struct HeadConfig {
  Pooling pooling = Pooling::mean;
  Pooler pooler = Pooler::none;  // encoder only: between pooling and the classifier
  index_t num_classes = 4;
  bool head_bias = true;  // the head (the classifier's, or a decoder's LM head) has a bias
  // decoder and encoder_decoder: the LM head is the (decoder's) embedding matrix, its gradient
  // summed into the embedding's
  bool tie_embeddings = false;
  double label_smoothing = 0.0;

  bool operator==(const HeadConfig&) const = default;
};

struct ModelConfig {
  Architecture architecture = Architecture::encoder;
  index_t d_model = 16;
  index_t num_layers = 2;
  // encoder_decoder only: the decoder's layers (unset: num_layers)
  std::optional<index_t> decoder_layers{};
  double dropout = 0.0;  // one probability for every dropout site

  EmbeddingsConfig embeddings{};
  AttentionConfig attention{};
  FfnConfig ffn{};
  NormsConfig norms{};
  HeadConfig head{};
  std::optional<QuantizationConfig> quantization{};

  // Dh, each head's q and k width: head_dim, else d_model / num_heads (MLA: Dn + Dr).
  index_t d_head() const {
    if (attention.mla()) return attention.qk_nope_head_dim + attention.qk_rope_head_dim;
    return attention.head_dim.value_or(d_model / attention.num_heads);
  }
  // Dv, each head's v width: Dh (MLA: v_head_dim).
  index_t v_head() const { return attention.mla() ? attention.v_head_dim : d_head(); }
  // The width of q, H * Dh: d_model unless head_dim (or MLA) says otherwise.
  index_t attn_width() const { return attention.num_heads * d_head(); }
  // The width of the attention's context and the output projection's input, H * Dv.
  index_t context_width() const { return attention.num_heads * v_head(); }
  bool patches_input() const { return embeddings.input == InputKind::patches; }
  // The number of patches of an image: (image_size / patch_size)^2; 0 with input "tokens", and
  // for sizes validate() refuses (not positive, or more than 2^20 patches a side).
  index_t patches() const {
    const EmbeddingsConfig& e = embeddings;
    if (!patches_input() || e.image_size <= 0 || e.patch_size <= 0) return 0;
    const index_t side = e.image_size / e.patch_size;
    return side <= (index_t{1} << 20) ? side * side : 0;
  }
  index_t kv_heads() const { return attention.num_kv_heads.value_or(attention.num_heads); }
  // Layer i's sliding window: sliding_window, unless layer_types makes the layer full.
  std::optional<index_t> window(index_t layer) const {
    const auto& t = attention.layer_types;
    const auto i = static_cast<std::size_t>(layer);
    if (i < t.size() && t[i] == LayerAttention::full) return std::nullopt;
    return attention.sliding_window;
  }
  // The dimensions RoPE rotates: rotary_dim, else Dh (MLA: the last Dr of each head).
  index_t rotary() const {
    if (attention.mla()) return attention.qk_rope_head_dim;
    return attention.rotary_dim.value_or(d_head());
  }
  // A gated FFN: swiglu, geglu, and an MoE model's dense layers.
  bool gated() const { return ffn.kind != FfnKind::mlp; }
  bool moe() const { return ffn.kind == FfnKind::moe; }
  // Whether layer i's FFN is a mixture of experts (MoeConfig: first_dense_layers, moe_every).
  bool moe_layer(index_t i) const {
    return moe() && i >= ffn.moe.first_dense_layers && (i + 1) % ffn.moe.moe_every == 0;
  }
  bool encoder() const { return architecture == Architecture::encoder; }
  bool decoder() const { return architecture == Architecture::decoder; }
  bool encoder_decoder() const { return architecture == Architecture::encoder_decoder; }
  // An LM head over a vocabulary (a decoder, or an encoder-decoder's decoder): no pooling.
  bool lm() const { return decoder() || encoder_decoder(); }
  index_t dec_layers() const { return decoder_layers.value_or(num_layers); }
  Positional dec_positional() const {
    return embeddings.decoder_positional.value_or(embeddings.positional);
  }
  // The vocabulary of the LM head (Vt): the decoder's own, else vocab_size.
  index_t target_vocab() const {
    return embeddings.decoder_vocab_size.value_or(embeddings.vocab_size);
  }
  // The FFN's activation: silu for swiglu (and an MoE model's dense layers), else `activation`
  // (gelu or gelu_tanh for geglu).
  Activation ffn_activation() const {
    return ffn.kind == FfnKind::swiglu || moe() ? Activation::silu : ffn.activation;
  }

  // Throws ConfigError naming the first invalid field and its value; ShapeError when a parameter
  // tensor's element or byte count would overflow 64 bits.
  void validate() const;

  // Reads every key present; absent keys keep their defaults. Unknown keys, wrong types and
  // out-of-range values throw ConfigError. The result is validated.
  static ModelConfig from_json(const nlohmann::json& j);
  static ModelConfig from_json_text(const std::string& text);
  // The architecture a config object names: "encoder" when the key is absent, and also when its
  // value is not a string (from_json then refuses that value by name).
  static std::string architecture_of(const nlohmann::json& j);
  static ModelConfig from_file(const std::string& path);
  nlohmann::json to_json() const;

  bool operator==(const ModelConfig&) const = default;
};

// The name this type had before its sections.
using EncoderConfig [[deprecated("use teo::ModelConfig")]] = ModelConfig;

// The shape of one forward/backward call. Validated against a config before anything is
// allocated: seq_len in [1, max_len], batch >= 0, and every activation's byte count fits in 64
// bits.
struct BatchShape {
  index_t batch = 0;
  index_t seq_len = 0;  // an encoder_decoder's source length
  index_t tgt_len = 0;  // an encoder_decoder's target length (0 for the other architectures)
};
void validate_batch_shape(const ModelConfig& cfg, const BatchShape& shape, std::size_t real_size);

// Bounds that validation enforces before anything is allocated, so that an oversized request gets
// a named ShapeError instead of being killed by the kernel for running out of memory.
struct MemoryLimits {
  // No single parameter or activation tensor may have more elements than this.
  index_t max_tensor_elements = index_t{1} << 32;
  // Neither the parameters (at 8 bytes each) nor everything one forward pass keeps (the bound in
  // docs/semantics.md section 11) may need more bytes than this. Default: this machine's physical
  // memory.
  index_t max_total_bytes = 0;
};
// The limits in force: set_memory_limits(), else TEO_MAX_TENSOR_ELEMENTS and TEO_MAX_BYTES from
// the environment, else the defaults. A malformed variable is a ConfigError naming it.
MemoryLimits memory_limits();
void set_memory_limits(const MemoryLimits& limits);  // ConfigError unless both are >= 1

}  // namespace teo
