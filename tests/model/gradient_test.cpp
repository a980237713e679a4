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
  EncoderConfig cfg;
  std::vector<std::int64_t> lengths;
  std::vector<std::int64_t> tgt_lengths;  // an encoder_decoder's targets (of 5 tokens)
};

EncoderConfig tiny() {
  EncoderConfig c;
  c.vocab_size = 11;
  c.max_len = 6;
  c.d_model = 8;
  c.num_heads = 2;
  c.d_ff = 12;
  c.num_layers = 2;
  c.num_classes = 3;
  return c;
}

void PrintTo(const GradCase& c, std::ostream* os) {
  *os << c.name;
}

std::vector<GradCase> cases() {
  std::vector<GradCase> out;
  auto add = [&](std::string name, std::vector<std::int64_t> len, auto&& edit) {
    EncoderConfig c = tiny();
    edit(c);
    out.push_back({std::move(name), c, std::move(len), {}});
  };
  add("PostNormGeluMeanLengths410", {4, 1, 0}, [](EncoderConfig&) {});
  add("PreNormGeluTanhClsCausalSmoothing", {4, 4, 4}, [](EncoderConfig& c) {
    c.norm_first = true;
    c.activation = Activation::gelu_tanh;
    c.pooling = Pooling::cls;
    c.causal = true;
    c.label_smoothing = 0.1;
  });
  add("PostNormReluMaxLearnedScaled", {4, 2, 1}, [](EncoderConfig& c) {
    c.activation = Activation::relu;
    c.pooling = Pooling::max;
    c.positional = Positional::learned;
    c.embed_scale = true;
  });
  add("PreNormReluMeanDropoutCausal", {4, 0, 3}, [](EncoderConfig& c) {
    c.norm_first = true;
    c.activation = Activation::relu;
    c.dropout = 0.2;
    c.causal = true;
    c.label_smoothing = 0.2;
  });
  add("PostNormGeluClsDropoutLearnedLength0", {1, 4, 0}, [](EncoderConfig& c) {
    c.pooling = Pooling::cls;
    c.dropout = 0.1;
    c.positional = Positional::learned;
  });
  add("PreNormGeluMaxOneLayerScaled", {4, 3, 4}, [](EncoderConfig& c) {
    c.norm_first = true;
    c.pooling = Pooling::max;
    c.num_layers = 1;
    c.embed_scale = true;
    c.num_heads = 1;
  });
  add("PostNormGeluTanhMeanCausalThreeHeadsOddDh", {4, 1, 3}, [](EncoderConfig& c) {
    c.d_model = 9;
    c.num_heads = 3;
    c.activation = Activation::gelu_tanh;
    c.causal = true;
  });
  add("PostNormReluMaxLength0FullSmoothing", {4, 0, 2}, [](EncoderConfig& c) {
    c.activation = Activation::relu;
    c.pooling = Pooling::max;
    c.label_smoothing = 1.0;
  });
  add("ZeroLayersPreNormMeanLearned", {4, 2, 0}, [](EncoderConfig& c) {
    c.num_layers = 0;
    c.norm_first = true;
    c.positional = Positional::learned;
  });
  add("ZeroLayersPostNormMax", {3, 4, 1}, [](EncoderConfig& c) {
    c.num_layers = 0;
    c.pooling = Pooling::max;
  });
  // The attention variants, alone and combined (docs/semantics.md, "Attention variants").
  add("GqaTwoKvHeadsOfFour", {4, 1, 3}, [](EncoderConfig& c) {
    c.num_heads = 4;
    c.num_kv_heads = 2;
  });
  add("MqaPreNormCausal", {4, 2, 0}, [](EncoderConfig& c) {
    c.num_heads = 4;
    c.num_kv_heads = 1;
    c.norm_first = true;
    c.causal = true;
  });
  add("RopeNeoxPartialOffset", {4, 3, 1}, [](EncoderConfig& c) {
    c.positional = Positional::rope;
    c.rotary_dim = 2;
    c.position_offset = 3;
  });
  add("RopeInterleavedYarnLargeOffset", {4, 2, 4}, [](EncoderConfig& c) {
    c.positional = Positional::rope;
    c.rope_style = RopeStyle::interleaved;
    c.rope_scaling = {.type = RopeScalingType::yarn, .factor = 4.0, .original_max_len = 2};
    c.position_offset = 100000;
  });
  add("RopeNtkBeyondTheOriginalContext", {4, 4, 2}, [](EncoderConfig& c) {
    c.positional = Positional::rope;
    c.rope_scaling = {.type = RopeScalingType::ntk, .factor = 2.0, .original_max_len = 3};
    c.num_layers = 1;
  });
  add("RopeLinearCausal", {4, 1, 2}, [](EncoderConfig& c) {
    c.positional = Positional::rope;
    c.rope_scaling = {.type = RopeScalingType::linear, .factor = 3.0};
    c.causal = true;
  });
  add("AlibiCausalThreeHeads", {4, 3, 1}, [](EncoderConfig& c) {
    c.d_model = 9;
    c.num_heads = 3;
    c.positional = Positional::alibi;
    c.causal = true;
  });
  add("AlibiBidirectionalMaxBias", {4, 2, 4}, [](EncoderConfig& c) {
    c.positional = Positional::alibi;
    c.alibi_max_bias = 2.0;
  });
  add("SlidingWindowCausal2", {4, 3, 0}, [](EncoderConfig& c) {
    c.causal = true;
    c.sliding_window = 2;
  });
  add("SlidingWindowBidirectional1", {4, 2, 3}, [](EncoderConfig& c) { c.sliding_window = 1; });
  add("SoftcapHalf", {4, 2, 3}, [](EncoderConfig& c) { c.attn_logit_softcap = 0.5; });
  add("SinksFullyMaskedRow", {4, 0, 2}, [](EncoderConfig& c) {
    c.attn_sinks = true;
    c.causal = true;
  });
  add("GqaRopeWindow", {4, 3, 2}, [](EncoderConfig& c) {
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.positional = Positional::rope;
    c.sliding_window = 2;
    c.causal = true;
  });
  add("SinksWithSoftcap", {4, 1, 3}, [](EncoderConfig& c) {
    c.attn_sinks = true;
    c.attn_logit_softcap = 0.7;
  });
  add("EverythingRopeDropoutPre", {4, 0, 3}, [](EncoderConfig& c) {
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.positional = Positional::rope;
    c.rotary_dim = 2;
    c.rope_scaling = {.type = RopeScalingType::yarn, .factor = 2.0};
    c.position_offset = 7;
    c.sliding_window = 3;
    c.attn_logit_softcap = 0.8;
    c.attn_sinks = true;
    c.norm_first = true;
    c.dropout = 0.2;
  });
  add("EverythingAlibiCausal", {4, 2, 1}, [](EncoderConfig& c) {
    c.d_model = 12;
    c.num_heads = 6;
    c.num_kv_heads = 3;
    c.positional = Positional::alibi;
    c.causal = true;
    c.sliding_window = 2;
    c.attn_logit_softcap = 0.6;
    c.attn_sinks = true;
  });
  // The block variants (docs/semantics.md, section 17.1).
  add("LlamaBlockRmsSwigluNoBiasesGqaRope", {4, 1, 3}, [](EncoderConfig& c) {
    c.norm = Norm::rmsnorm;
    c.ffn = FfnKind::swiglu;
    c.ffn_bias = c.attn_bias = c.head_bias = false;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.positional = Positional::rope;
    c.norm_first = true;
    c.causal = true;
  });
  add("PostNormRmsGegluTanhDropout", {4, 0, 2}, [](EncoderConfig& c) {
    c.norm = Norm::rmsnorm;
    c.ffn = FfnKind::geglu;
    c.activation = Activation::gelu_tanh;
    c.dropout = 0.2;
  });
  add("PreNormSwigluNoAttnOrHeadBias", {4, 3, 1}, [](EncoderConfig& c) {
    c.norm_first = true;
    c.ffn = FfnKind::swiglu;
    c.head_bias = false;
    c.attn_bias = false;
    c.pooling = Pooling::cls;
  });
  add("PostNormMlpSiluNoFfnBias", {4, 2, 4}, [](EncoderConfig& c) {
    c.activation = Activation::silu;
    c.ffn_bias = false;
  });
  // Real encoders (semantics 18): BERT's token types, embedding LayerNorm (before the input
  // dropout) and pooler; then pre-norm with an RMS embedding norm, three types and mean pooling.
  add("BertPostNormTypesEmbNormPoolerClsLearnedDropout", {4, 2, 1}, [](EncoderConfig& c) {
    c.type_vocab_size = 2;
    c.embedding_norm = true;
    c.pooler = Pooler::dense_tanh;
    c.pooling = Pooling::cls;
    c.positional = Positional::learned;
    c.position_offset = 2;
    c.dropout = 0.1;
    c.label_smoothing = 0.1;
  });
  add("PreNormRmsEmbNormTypes3PoolerMean", {4, 0, 3}, [](EncoderConfig& c) {
    c.norm_first = true;
    c.norm = Norm::rmsnorm;
    c.type_vocab_size = 3;
    c.embedding_norm = true;
    c.pooler = Pooler::dense_tanh;
  });
  // ViT (semantics 18.5): images of 3 channels, 4 x 4 pixels, in four 2 x 2 patches after [CLS]
  add("VitPreNormPatchesClsLearnedDropout", {5, 5, 5}, [](EncoderConfig& c) {
    c.input = InputKind::patches;
    c.image_size = 4;
    c.patch_size = 2;
    c.channels = 3;
    c.max_len = 5;
    c.norm_first = true;
    c.pooling = Pooling::cls;
    c.positional = Positional::learned;
    c.dropout = 0.1;
  });
  add("VitPostNormPatchesMeanPooler", {5, 5}, [](EncoderConfig& c) {
    c.input = InputKind::patches;
    c.image_size = 2;
    c.patch_size = 1;
    c.channels = 2;
    c.max_len = 5;
    c.pooler = Pooler::dense_tanh;
    c.embedding_norm = true;
  });
  // Decoders: next-token loss over the real positions, the LM head tied or its own.
  add("DecoderPreNormTiedLearnedSmoothingDropout", {4, 1, 0}, [](EncoderConfig& c) {
    c.architecture = Architecture::decoder;
    c.num_classes = EncoderConfig{}.num_classes;  // a decoder has no classifier
    c.causal = true;
    c.norm_first = true;
    c.tie_embeddings = true;
    c.head_bias = false;
    c.positional = Positional::learned;
    c.label_smoothing = 0.1;
    c.dropout = 0.1;
  });
  add("DecoderLlamaRmsSwigluGqaRope", {4, 3, 2}, [](EncoderConfig& c) {
    c.architecture = Architecture::decoder;
    c.num_classes = EncoderConfig{}.num_classes;  // a decoder has no classifier
    c.causal = true;
    c.norm_first = true;
    c.norm = Norm::rmsnorm;
    c.ffn = FfnKind::swiglu;
    c.attn_bias = c.ffn_bias = c.head_bias = false;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.positional = Positional::rope;
  });
  add("DecoderPostNormOwnHeadWithBias", {4, 4, 2}, [](EncoderConfig& c) {
    c.architecture = Architecture::decoder;
    c.num_classes = EncoderConfig{}.num_classes;  // a decoder has no classifier
    c.causal = true;
  });
  // encoder-decoders: a source of length 0, targets of 5, 3 and 1 tokens (the seed notes' form);
  // then pre-norm with the decoder's own tied vocabulary, learned positions, RMSNorm, SwiGLU
  add("Seq2SeqPostNormSharedVocabSource0", {4, 2, 0}, [](EncoderConfig& c) {
    c.architecture = Architecture::encoder_decoder;
    c.num_classes = EncoderConfig{}.num_classes;
  });
  out.back().tgt_lengths = {5, 3, 1};
  add("Seq2SeqPreNormOwnTiedVocabLearnedRmsSwiglu", {4, 3, 1}, [](EncoderConfig& c) {
    c.architecture = Architecture::encoder_decoder;
    c.num_classes = EncoderConfig{}.num_classes;
    c.norm_first = true;
    c.decoder_vocab_size = 7;
    c.tie_embeddings = true;
    c.positional = Positional::learned;
    c.norm = Norm::rmsnorm;
    c.ffn = FfnKind::swiglu;
    c.attn_bias = false;
    c.label_smoothing = 0.1;
    c.decoder_layers = 1;
  });
  out.back().tgt_lengths = {5, 0, 2};
  return out;
}

// Distance from the nearest kink the finite differences must not straddle: ReLU's 0 for every
// FFN pre-activation, and the gap between the largest and second-largest value of each pooled
// feature under max pooling. Real positions only: padded positions cannot reach the loss.
double kink_margin(const EncoderConfig& cfg, const Batch& batch, const Activations<double>& a) {
  double margin = INFINITY;
  const index_t s = batch.seq_len;
  if (cfg.activation == Activation::relu) {
    for (const auto& l : a.layers)
      for (index_t b = 0; b < batch.batch; ++b)
        for (index_t t = 0; t < batch.lengths[b]; ++t)
          for (index_t f = 0; f < cfg.d_ff; ++f)
            margin = std::min(margin, std::abs(l.ffn_pre[(b * s + t) * cfg.d_ff + f]));
  }
  if (cfg.pooling == Pooling::max) {
    const Tensor<double>& top = cfg.norm_first   ? a.final_norm
                                : cfg.num_layers ? a.layers.back().output
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
  const EncoderConfig& cfg = gc.cfg;
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
