// Whole-model gradients against central finite differences in double: every parameter and the
// input embedding (act.input), over configs that together cover post- and pre-norm, every
// activation, every pooling, lengths 0, 1 and full, causal on and off, label smoothing, dropout
// (the masks are a pure function of the seed, so the perturbed forwards replay them), learned
// and sinusoidal positions, and embedding scaling.
#include <cmath>
#include <iostream>

#include "support.hpp"

namespace teo {
namespace {

struct GradCase {
  std::string name;
  ModelConfig cfg;
  std::vector<std::int64_t> lengths;
  std::vector<std::int64_t> tgt_lengths;  // an encoder_decoder's targets (of 5 tokens)
};

ModelConfig tiny() {
  ModelConfig c;
  c.embeddings.vocab_size = 11;
  c.embeddings.max_len = 6;
  c.d_model = 8;
  c.attention.num_heads = 2;
  c.ffn.d_ff = 12;
  c.num_layers = 2;
  c.head.num_classes = 3;
  return c;
}

void PrintTo(const GradCase& c, std::ostream* os) {
  *os << c.name;
}

std::vector<GradCase> cases() {
  std::vector<GradCase> out;
  auto add = [&](std::string name, std::vector<std::int64_t> len, auto&& edit) {
    ModelConfig c = tiny();
    edit(c);
    out.push_back({std::move(name), c, std::move(len), {}});
  };
  add("PostNormGeluMeanLengths410", {4, 1, 0}, [](ModelConfig&) {});
  add("PreNormGeluTanhClsCausalSmoothing", {4, 4, 4}, [](ModelConfig& c) {
    c.norms.norm_first = true;
    c.ffn.activation = Activation::gelu_tanh;
    c.head.pooling = Pooling::cls;
    c.attention.causal = true;
    c.head.label_smoothing = 0.1;
  });
  add("PostNormReluMaxLearnedScaled", {4, 2, 1}, [](ModelConfig& c) {
    c.ffn.activation = Activation::relu;
    c.head.pooling = Pooling::max;
    c.embeddings.positional = Positional::learned;
    c.embeddings.embed_scale = true;
  });
  add("PreNormReluMeanDropoutCausal", {4, 0, 3}, [](ModelConfig& c) {
    c.norms.norm_first = true;
    c.ffn.activation = Activation::relu;
    c.dropout = 0.2;
    c.attention.causal = true;
    c.head.label_smoothing = 0.2;
  });
  add("PostNormGeluClsDropoutLearnedLength0", {1, 4, 0}, [](ModelConfig& c) {
    c.head.pooling = Pooling::cls;
    c.dropout = 0.1;
    c.embeddings.positional = Positional::learned;
  });
  add("PreNormGeluMaxOneLayerScaled", {4, 3, 4}, [](ModelConfig& c) {
    c.norms.norm_first = true;
    c.head.pooling = Pooling::max;
    c.num_layers = 1;
    c.embeddings.embed_scale = true;
    c.attention.num_heads = 1;
  });
  add("PostNormGeluTanhMeanCausalThreeHeadsOddDh", {4, 1, 3}, [](ModelConfig& c) {
    c.d_model = 9;
    c.attention.num_heads = 3;
    c.ffn.activation = Activation::gelu_tanh;
    c.attention.causal = true;
  });
  add("PostNormReluMaxLength0FullSmoothing", {4, 0, 2}, [](ModelConfig& c) {
    c.ffn.activation = Activation::relu;
    c.head.pooling = Pooling::max;
    c.head.label_smoothing = 1.0;
  });
  add("ZeroLayersPreNormMeanLearned", {4, 2, 0}, [](ModelConfig& c) {
    c.num_layers = 0;
    c.norms.norm_first = true;
    c.embeddings.positional = Positional::learned;
  });
  add("ZeroLayersPostNormMax", {3, 4, 1}, [](ModelConfig& c) {
    c.num_layers = 0;
    c.head.pooling = Pooling::max;
  });
  // The attention variants, alone and combined (docs/semantics.md, "Attention variants").
  add("GqaTwoKvHeadsOfFour", {4, 1, 3}, [](ModelConfig& c) {
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
  });
  add("MqaPreNormCausal", {4, 2, 0}, [](ModelConfig& c) {
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 1;
    c.norms.norm_first = true;
    c.attention.causal = true;
  });
  add("RopeNeoxPartialOffset", {4, 3, 1}, [](ModelConfig& c) {
    c.embeddings.positional = Positional::rope;
    c.attention.rotary_dim = 2;
    c.embeddings.position_offset = 3;
  });
  add("RopeInterleavedYarnLargeOffset", {4, 2, 4}, [](ModelConfig& c) {
    c.embeddings.positional = Positional::rope;
    c.attention.rope_style = RopeStyle::interleaved;
    c.attention.rope_scaling = {
        .type = RopeScalingType::yarn, .factor = 4.0, .original_max_len = 2};
    c.embeddings.position_offset = 100000;
  });
  add("RopeNtkBeyondTheOriginalContext", {4, 4, 2}, [](ModelConfig& c) {
    c.embeddings.positional = Positional::rope;
    c.attention.rope_scaling = {.type = RopeScalingType::ntk, .factor = 2.0, .original_max_len = 3};
    c.num_layers = 1;
  });
  add("RopeLinearCausal", {4, 1, 2}, [](ModelConfig& c) {
    c.embeddings.positional = Positional::rope;
    c.attention.rope_scaling = {.type = RopeScalingType::linear, .factor = 3.0};
    c.attention.causal = true;
  });
  add("AlibiCausalThreeHeads", {4, 3, 1}, [](ModelConfig& c) {
    c.d_model = 9;
    c.attention.num_heads = 3;
    c.embeddings.positional = Positional::alibi;
    c.attention.causal = true;
  });
  add("AlibiBidirectionalMaxBias", {4, 2, 4}, [](ModelConfig& c) {
    c.embeddings.positional = Positional::alibi;
    c.attention.alibi_max_bias = 2.0;
  });
  add("SlidingWindowCausal2", {4, 3, 0}, [](ModelConfig& c) {
    c.attention.causal = true;
    c.attention.sliding_window = 2;
  });
  add("SlidingWindowBidirectional1", {4, 2, 3},
      [](ModelConfig& c) { c.attention.sliding_window = 1; });
  add("SoftcapHalf", {4, 2, 3}, [](ModelConfig& c) { c.attention.attn_logit_softcap = 0.5; });
  add("SinksFullyMaskedRow", {4, 0, 2}, [](ModelConfig& c) {
    c.attention.attn_sinks = true;
    c.attention.causal = true;
  });
  add("GqaRopeWindow", {4, 3, 2}, [](ModelConfig& c) {
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
    c.embeddings.positional = Positional::rope;
    c.attention.sliding_window = 2;
    c.attention.causal = true;
  });
  add("SinksWithSoftcap", {4, 1, 3}, [](ModelConfig& c) {
    c.attention.attn_sinks = true;
    c.attention.attn_logit_softcap = 0.7;
  });
  add("EverythingRopeDropoutPre", {4, 0, 3}, [](ModelConfig& c) {
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
    c.embeddings.positional = Positional::rope;
    c.attention.rotary_dim = 2;
    c.attention.rope_scaling = {.type = RopeScalingType::yarn, .factor = 2.0};
    c.embeddings.position_offset = 7;
    c.attention.sliding_window = 3;
    c.attention.attn_logit_softcap = 0.8;
    c.attention.attn_sinks = true;
    c.norms.norm_first = true;
    c.dropout = 0.2;
  });
  add("EverythingAlibiCausal", {4, 2, 1}, [](ModelConfig& c) {
    c.d_model = 12;
    c.attention.num_heads = 6;
    c.attention.num_kv_heads = 3;
    c.embeddings.positional = Positional::alibi;
    c.attention.causal = true;
    c.attention.sliding_window = 2;
    c.attention.attn_logit_softcap = 0.6;
    c.attention.attn_sinks = true;
  });
  // The block variants (docs/semantics.md, section 17.1).
  add("LlamaBlockRmsSwigluNoBiasesGqaRope", {4, 1, 3}, [](ModelConfig& c) {
    c.norms.norm = Norm::rmsnorm;
    c.ffn.kind = FfnKind::swiglu;
    c.ffn.ffn_bias = c.attention.attn_bias = c.head.head_bias = false;
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
    c.embeddings.positional = Positional::rope;
    c.norms.norm_first = true;
    c.attention.causal = true;
  });
  add("PostNormRmsGegluTanhDropout", {4, 0, 2}, [](ModelConfig& c) {
    c.norms.norm = Norm::rmsnorm;
    c.ffn.kind = FfnKind::geglu;
    c.ffn.activation = Activation::gelu_tanh;
    c.dropout = 0.2;
  });
  add("PreNormSwigluNoAttnOrHeadBias", {4, 3, 1}, [](ModelConfig& c) {
    c.norms.norm_first = true;
    c.ffn.kind = FfnKind::swiglu;
    c.head.head_bias = false;
    c.attention.attn_bias = false;
    c.head.pooling = Pooling::cls;
  });
  // Qwen2's attention: q, k and v biases, none on the output projection
  add("PreNormQkvBiasWithoutOutputBias", {4, 3, 1}, [](ModelConfig& c) {
    c.norms.norm_first = true;
    c.attention.attn_out_bias = false;
    c.head.pooling = Pooling::cls;
  });
  // Qwen3's attention: q and k RMS-normalised per head before RoPE, GQA, no biases, heads of 6
  // (H Dh = 24 against D = 8, as Qwen3-30B-A3B's 32 heads of 128 against 2048)
  add("QkNormRopeGqaPreNormRmsHeadDim", {4, 3, 1}, [](ModelConfig& c) {
    c.attention.qk_norm = true;
    c.attention.head_dim = 6;
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
    c.embeddings.positional = Positional::rope;
    c.norms.norm = Norm::rmsnorm;
    c.norms.norm_first = true;
    c.attention.attn_bias = false;
    c.attention.causal = true;
  });
  // gpt-oss's attention: sliding and full layers alternating, sinks, every bias, heads of
  // head_dim apart from d_model, YaRN with its fractional correction range (truncate false)
  add("GptOssLayerTypesSinksYarnUntruncatedHeadDim", {4, 4, 2}, [](ModelConfig& c) {
    c.architecture = Architecture::decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;  // a decoder has no classifier
    c.attention.causal = true;
    c.norms.norm_first = true;
    c.norms.norm = Norm::rmsnorm;
    c.num_layers = 2;
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
    c.attention.head_dim = 6;
    c.attention.attn_sinks = true;
    c.attention.sliding_window = 2;
    c.attention.layer_types = {LayerAttention::sliding, LayerAttention::full};
    c.embeddings.positional = Positional::rope;
    // base 100 over 64 positions: the correction range [0, 1.51], [0, 2] when truncated
    c.attention.rope_base = 100.0;
    c.attention.rope_scaling = {
        .type = RopeScalingType::yarn, .factor = 4.0, .original_max_len = 64, .truncate = false};
  });
  // heads narrower than d_model / num_heads, every bias (the output projection's reads H Dh)
  add("HeadDimNarrowerPostNormBiases", {4, 3, 2}, [](ModelConfig& c) {
    c.attention.head_dim = 3;
    c.attention.num_kv_heads = 1;
  });
  // DeepSeek-V3's multi-head latent attention: q from its own latent, k and v from a normalised
  // latent with one shared RoPE key (interleaved), v narrower than q and k; YaRN with
  // mscale_all_dim scaling the scores, past the original context of 2
  add("MlaQLoraYarnMscaleInterleavedPreNorm", {4, 3, 2}, [](ModelConfig& c) {
    c.architecture = Architecture::decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;  // a decoder has no classifier
    c.attention.causal = true;
    c.norms.norm_first = true;
    c.norms.norm = Norm::rmsnorm;
    c.attention.attn_bias = false;
    c.attention.kv_lora_rank = 5;
    c.attention.q_lora_rank = 6;
    c.attention.qk_nope_head_dim = 3;
    c.attention.qk_rope_head_dim = 4;
    c.attention.v_head_dim = 2;
    c.attention.rope_style = RopeStyle::interleaved;
    c.embeddings.positional = Positional::rope;
    c.attention.rope_scaling = {.type = RopeScalingType::yarn,
                                .factor = 4.0,
                                .original_max_len = 2,
                                .mscale = 0.8,
                                .mscale_all_dim = 1.2};
  });
  // DeepSeek-V2-Lite's: q straight from x (no q latent); three heads whose v is wider than q and
  // k, post-norm LayerNorm, a window and attention dropout
  add("MlaNoQLoraPostNormWindowDropout", {4, 2, 3}, [](ModelConfig& c) {
    c.attention.num_heads = 3;
    c.attention.attn_bias = false;
    c.attention.kv_lora_rank = 3;
    c.attention.qk_nope_head_dim = 2;
    c.attention.qk_rope_head_dim = 2;
    c.attention.v_head_dim = 5;
    c.embeddings.positional = Positional::rope;
    c.attention.sliding_window = 2;
    c.dropout = 0.2;
  });
  // without RoPE, attention reads the norms themselves
  add("QkNormPostNormSinusoidalDropout", {4, 2, 3}, [](ModelConfig& c) {
    c.attention.qk_norm = true;
    c.dropout = 0.2;
  });
  add("PostNormMlpSiluNoFfnBias", {4, 2, 4}, [](ModelConfig& c) {
    c.ffn.activation = Activation::silu;
    c.ffn.ffn_bias = false;
  });
  // Real encoders (semantics 18): BERT's token types, embedding LayerNorm (before the input
  // dropout) and pooler; then pre-norm with an RMS embedding norm, three types and mean pooling.
  add("BertPostNormTypesEmbNormPoolerClsLearnedDropout", {4, 2, 1}, [](ModelConfig& c) {
    c.embeddings.type_vocab_size = 2;
    c.embeddings.embedding_norm = true;
    c.head.pooler = Pooler::dense_tanh;
    c.head.pooling = Pooling::cls;
    c.embeddings.positional = Positional::learned;
    c.embeddings.position_offset = 2;
    c.dropout = 0.1;
    c.head.label_smoothing = 0.1;
  });
  add("PreNormRmsEmbNormTypes3PoolerMean", {4, 0, 3}, [](ModelConfig& c) {
    c.norms.norm_first = true;
    c.norms.norm = Norm::rmsnorm;
    c.embeddings.type_vocab_size = 3;
    c.embeddings.embedding_norm = true;
    c.head.pooler = Pooler::dense_tanh;
  });
  // ViT (semantics 18.5): images of 3 channels, 4 x 4 pixels, in four 2 x 2 patches after [CLS]
  add("VitPreNormPatchesClsLearnedDropout", {5, 5, 5}, [](ModelConfig& c) {
    c.embeddings.input = InputKind::patches;
    c.embeddings.image_size = 4;
    c.embeddings.patch_size = 2;
    c.embeddings.channels = 3;
    c.embeddings.max_len = 5;
    c.norms.norm_first = true;
    c.head.pooling = Pooling::cls;
    c.embeddings.positional = Positional::learned;
    c.dropout = 0.1;
  });
  add("VitPostNormPatchesMeanPooler", {5, 5}, [](ModelConfig& c) {
    c.embeddings.input = InputKind::patches;
    c.embeddings.image_size = 2;
    c.embeddings.patch_size = 1;
    c.embeddings.channels = 2;
    c.embeddings.max_len = 5;
    c.head.pooler = Pooler::dense_tanh;
    c.embeddings.embedding_norm = true;
  });
  // Decoders: next-token loss over the real positions, the LM head tied or its own.
  add("DecoderPreNormTiedLearnedSmoothingDropout", {4, 1, 0}, [](ModelConfig& c) {
    c.architecture = Architecture::decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;  // a decoder has no classifier
    c.attention.causal = true;
    c.norms.norm_first = true;
    c.head.tie_embeddings = true;
    c.head.head_bias = false;
    c.embeddings.positional = Positional::learned;
    c.head.label_smoothing = 0.1;
    c.dropout = 0.1;
  });
  add("DecoderLlamaRmsSwigluGqaRope", {4, 3, 2}, [](ModelConfig& c) {
    c.architecture = Architecture::decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;  // a decoder has no classifier
    c.attention.causal = true;
    c.norms.norm_first = true;
    c.norms.norm = Norm::rmsnorm;
    c.ffn.kind = FfnKind::swiglu;
    c.attention.attn_bias = c.ffn.ffn_bias = c.head.head_bias = false;
    c.attention.num_heads = 4;
    c.attention.num_kv_heads = 2;
    c.embeddings.positional = Positional::rope;
  });
  add("DecoderPostNormOwnHeadWithBias", {4, 4, 2}, [](ModelConfig& c) {
    c.architecture = Architecture::decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;  // a decoder has no classifier
    c.attention.causal = true;
  });
  // encoder-decoders: a source of length 0, targets of 5, 3 and 1 tokens (the seed notes' form);
  // then pre-norm with the decoder's own tied vocabulary, learned positions, RMSNorm, SwiGLU
  add("Seq2SeqPostNormSharedVocabSource0", {4, 2, 0}, [](ModelConfig& c) {
    c.architecture = Architecture::encoder_decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;
  });
  out.back().tgt_lengths = {5, 3, 1};
  add("Seq2SeqPreNormOwnTiedVocabLearnedRmsSwiglu", {4, 3, 1}, [](ModelConfig& c) {
    c.architecture = Architecture::encoder_decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;
    c.norms.norm_first = true;
    c.embeddings.decoder_vocab_size = 7;
    c.head.tie_embeddings = true;
    c.embeddings.positional = Positional::learned;
    c.norms.norm = Norm::rmsnorm;
    c.ffn.kind = FfnKind::swiglu;
    c.attention.attn_bias = false;
    c.head.label_smoothing = 0.1;
    c.decoder_layers = 1;
  });
  out.back().tgt_lengths = {5, 0, 2};
  // Mixtures of experts (docs/semantics.md, 19.4): the router's gradient, the experts', the
  // shared experts' and the loss terms', every position routed, the loss terms over real tokens.
  const auto moe_decoder = [](ModelConfig& c) {
    c.architecture = Architecture::decoder;
    c.head.num_classes = ModelConfig{}.head.num_classes;
    c.attention.causal = true;
    c.norms.norm_first = true;
    c.norms.norm = Norm::rmsnorm;
    c.ffn.kind = FfnKind::moe;
    c.ffn.activation = Activation::silu;
    c.attention.attn_bias = c.ffn.ffn_bias = c.head.head_bias = false;
    c.embeddings.positional = Positional::rope;
    c.ffn.moe.num_experts = 4;
    c.ffn.moe.num_experts_per_tok = 2;
    c.ffn.moe.moe_d_ff = 6;
  };
  add("MoeMixtralDecoderTop2NormAuxZ", {4, 3, 2}, [&](ModelConfig& c) {
    moe_decoder(c);
    c.ffn.moe.norm_topk_prob = true;
    c.ffn.moe.router_aux_loss_coef = 0.5;
    c.ffn.moe.router_z_loss_coef = 0.25;
  });
  add("MoeDeepSeekDecoderSigmoidGroupsBiasSharedDenseFirst", {4, 4, 1}, [&](ModelConfig& c) {
    moe_decoder(c);
    MoeConfig& m = c.ffn.moe;
    m.num_experts = 8;
    m.router_scoring = RouterScoring::sigmoid;
    m.router_groups = 4;
    m.topk_groups = 2;
    m.selection_bias = true;
    m.norm_topk_prob = true;
    m.routed_scaling_factor = 2.5;
    m.shared_d_ff = 6;
    m.first_dense_layers = 1;
    m.router_aux_loss_coef = 0.5;
  });
  add("MoeGptOssEncoderTopkThenScoreClampedBiases", {4, 1, 0}, [&](ModelConfig& c) {
    c.ffn.kind = FfnKind::moe;
    c.ffn.activation = Activation::silu;
    MoeConfig& m = c.ffn.moe;
    m.num_experts = 4;
    m.num_experts_per_tok = 2;
    m.moe_d_ff = 5;
    m.router_order = RouterOrder::topk_then_score;
    m.router_bias = true;
    m.expert_bias = true;
    m.expert_kind = ExpertKind::clamped_swiglu;
    m.swiglu_limit = 0.4;  // active for some of the drawn pre-activations
  });
  add("MoeLlama4DecoderTop1SigmoidAtInputSharedGateEvery2", {4, 2, 3}, [&](ModelConfig& c) {
    moe_decoder(c);
    MoeConfig& m = c.ffn.moe;
    m.num_experts_per_tok = 1;
    m.router_scoring = RouterScoring::sigmoid;
    m.router_order = RouterOrder::topk_then_score;
    m.weight_at_input = true;
    m.shared_d_ff = 5;
    m.shared_expert_gate = true;
    m.moe_every = 2;
  });
  return out;
}

// Distance from the nearest kink the finite differences must not straddle: ReLU's 0 for every
// FFN pre-activation, and the gap between the largest and second-largest value of each pooled
// feature under max pooling. Real positions only: padded positions cannot reach the loss.
double kink_margin(const ModelConfig& cfg, const Batch& batch, const Activations<double>& a) {
  double margin = INFINITY;
  const index_t s = batch.seq_len;
  if (cfg.ffn.activation == Activation::relu) {
    for (const auto& l : a.layers)
      for (index_t b = 0; b < batch.batch; ++b)
        for (index_t t = 0; t < batch.lengths[b]; ++t)
          for (index_t f = 0; f < cfg.ffn.d_ff; ++f)
            margin = std::min(margin, std::abs(l.ffn_pre[(b * s + t) * cfg.ffn.d_ff + f]));
  }
  // A mixture of experts: each real token's selection margin, and the clamped SwiGLU's distance
  // from its limits on the real tokens' rows.
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    if (!a.moe_layer(i)) continue;
    const MoeActs<double>& m = a.layers[i].moe;
    const index_t k = cfg.ffn.moe.num_experts_per_tok, Fe = cfg.ffn.moe.moe_d_ff;
    const double limit = cfg.ffn.moe.swiglu_limit;
    const bool clamped = cfg.ffn.moe.expert_kind == ExpertKind::clamped_swiglu;
    for (std::size_t r = 0; r < m.source_rows.size(); ++r) {
      const index_t token = m.source_rows[r] / k, b = token / s, t = token % s;
      if (t >= batch.lengths[b]) continue;
      margin = std::min(margin, m.routing.margin[static_cast<std::size_t>(token)]);
      for (index_t f = 0; clamped && f < Fe; ++f) {
        const auto at = static_cast<std::size_t>(static_cast<index_t>(r) * Fe + f);
        margin = std::min({margin, std::abs(m.gate_pre[at] - limit), std::abs(m.up_pre[at] - limit),
                           std::abs(m.up_pre[at] + limit)});
      }
    }
  }
  if (cfg.head.pooling == Pooling::max) {
    const Tensor<double>& top = cfg.norms.norm_first ? a.final_norm
                                : cfg.num_layers     ? a.layers.back().output
                                                     : a.input;
    for (index_t b = 0; b < batch.batch; ++b)
      for (index_t c = 0; c < cfg.d_model; ++c) {
        double first = -INFINITY, second = -INFINITY;
        for (index_t t = 0; t < batch.lengths[b]; ++t) {
          const double v = top[(b * s + t) * cfg.d_model + c];
          if (v > first) {
            second = first;
            first = v;
          } else if (v > second) {
            second = v;
          }
        }
        if (batch.lengths[b] > 1) margin = std::min(margin, first - second);
      }
  }
  return margin;
}

class ModelGradient : public ::testing::TestWithParam<GradCase> {};

TEST_P(ModelGradient, BackwardMatchesFiniteDifferences) {
  const GradCase& gc = GetParam();
  const ModelConfig& cfg = gc.cfg;
  const index_t seq_len = cfg.patches_input() ? 1 + cfg.patches() : 4;
  const ForwardOptions opts{.train = true, .dropout_seed = 1234};
  // Inputs are chosen away from ReLU's kink and from max-pooling ties: the first seed whose
  // margin is at least 2e-3 (20 times the finite-difference step) is used, and asserted.
  Params<double> params;
  Batch batch;
  Activations<double> acts;
  double margin = 0;
  std::uint64_t seed = 0;
  for (; seed < 200; ++seed) {
    params = Params<double>::init(cfg, seed);
    test::randomise(params, seed);
    const auto B = static_cast<index_t>(gc.lengths.size());
    batch = cfg.encoder_decoder()
                ? Batch::random_seq2seq(cfg, B, seq_len, 5, seed, gc.lengths, gc.tgt_lengths)
                : Batch::random(cfg, B, seq_len, seed, gc.lengths);
    forward(params, batch, acts, opts);
    margin = kink_margin(cfg, batch, acts);
    if (margin >= 2e-3) break;
  }
  ASSERT_GE(margin, 2e-3) << "no seed below 200 keeps the inputs away from kinks";

  Params<double> grads;
  Activations<double> dacts;
  backward(params, batch, acts, grads, dacts);
  test::worst_fd_error() = 0;
  ASSERT_TRUE(std::isfinite(acts.loss[0]));

  auto loss = [&] {
    Activations<double> a;
    forward(params, batch, a, opts);
    return a.loss[0];
  };
  std::vector<std::pair<std::string, Tensor<double>*>> ps;
  params.visit([&](const std::string& n, Tensor<double>& t) { ps.emplace_back(n, &t); });
  std::vector<const Tensor<double>*> gs;
  grads.visit([&](const std::string&, const Tensor<double>& t) { gs.push_back(&t); });
  ASSERT_EQ(ps.size(), gs.size());
  for (std::size_t i = 0; i < ps.size(); ++i) {
    test::expect_gradient(ps[i].first, ps[i].second->data(),
                          test::to_double(gs[i]->data(), gs[i]->numel()), loss);
  }
  // The input embedding: perturb act.input and rerun the encoder from there.
  Activations<double> base = acts;
  auto loss_from_input = [&] {
    encoder_forward(params, batch, base, opts);
    return base.loss[0];
  };
  test::expect_gradient("act.input", base.input.data(),
                        test::to_double(dacts.input.data(), dacts.input.numel()), loss_from_input);
  std::cout << "[ measured ] " << gc.name << ": worst normwise FD error " << test::worst_fd_error()
            << " (bound " << test::kFdTolerance << ")\n";
  // Padded positions get exactly zero gradient at the input.
  for (index_t b = 0; b < batch.batch; ++b)
    for (index_t t = batch.lengths[b]; t < seq_len; ++t)
      for (index_t c = 0; c < cfg.d_model; ++c)
        EXPECT_EQ(dacts.input[(b * seq_len + t) * cfg.d_model + c], 0.0);
}

INSTANTIATE_TEST_SUITE_P(Configs, ModelGradient, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace teo
