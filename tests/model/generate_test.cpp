// Greedy generation with a KV cache (teo/generate.hpp) against the full causal forward pass: step
// t's logits are the forward's at the fed token's position, for prompts of length 0, 1 and 7, in
// both dtypes, on every backend.
#include <cstring>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/generate.hpp"

namespace teo {
namespace {

ModelConfig decoder_base() {
  ModelConfig c;
  c.architecture = Architecture::decoder;
  c.attention.causal = true;
  c.embeddings.vocab_size = 23;
  c.embeddings.max_len = 16;
  c.d_model = 16;
  c.attention.num_heads = 4;
  c.ffn.d_ff = 24;
  c.num_layers = 2;
  return c;
}

// DeepSeek-V3's router (sigmoid, selection bias, 4 groups choose 2, scaling 2.5), a shared
// expert and one dense layer first, on a LLaMA-style decoder.
ModelConfig moe_like(ModelConfig c) {
  c.ffn.kind = FfnKind::moe;
  MoeConfig& m = c.ffn.moe;
  m.num_experts = 8;
  m.num_experts_per_tok = 2;
  m.moe_d_ff = 6;
  m.router_scoring = RouterScoring::sigmoid;
  m.router_groups = 4;
  m.topk_groups = 2;
  m.selection_bias = true;
  m.norm_topk_prob = true;
  m.routed_scaling_factor = 2.5;
  m.shared_d_ff = 6;
  m.first_dense_layers = 1;
  c.validate();
  return c;
}

// GPT-2 (pre-norm, learned positions, tied head), LLaMA (RMSNorm, SwiGLU, RoPE YaRN with an
// offset, GQA, no biases) and a post-norm decoder with sinusoidal positions, and with ALiBi, MQA,
// a window, a soft-cap and sinks; and that LLaMA with DeepSeek-style experts.
std::vector<std::pair<std::string, ModelConfig>> configs() {
  std::vector<std::pair<std::string, ModelConfig>> out;
  ModelConfig gpt2 = decoder_base();
  gpt2.norms.norm_first = true;
  gpt2.embeddings.positional = Positional::learned;
  gpt2.ffn.activation = Activation::gelu_tanh;
  gpt2.head.tie_embeddings = true;
  gpt2.head.head_bias = false;
  out.emplace_back("gpt2", gpt2);
  ModelConfig llama = decoder_base();
  llama.norms.norm_first = true;
  llama.norms.norm = Norm::rmsnorm;
  llama.ffn.kind = FfnKind::swiglu;
  llama.ffn.activation = Activation::silu;
  llama.attention.attn_bias = llama.ffn.ffn_bias = llama.head.head_bias = false;
  llama.attention.num_kv_heads = 2;
  llama.embeddings.positional = Positional::rope;
  llama.attention.rope_scaling = {
      .type = RopeScalingType::yarn, .factor = 2.0, .original_max_len = 8};
  llama.embeddings.position_offset = 5;
  out.emplace_back("llama", llama);
  ModelConfig post = decoder_base();
  post.embeddings.embed_scale = true;
  out.emplace_back("post-norm sinusoidal", post);
  ModelConfig variants = decoder_base();
  variants.embeddings.positional = Positional::alibi;
  variants.attention.num_kv_heads = 1;
  variants.attention.sliding_window = 4;
  variants.attention.attn_logit_softcap = 3.0;
  variants.attention.attn_sinks = true;
  variants.ffn.kind = FfnKind::geglu;
  out.emplace_back("alibi mqa window softcap sinks geglu", variants);
  ModelConfig qwen3 = llama;
  qwen3.attention.qk_norm = true;
  qwen3.attention.head_dim = 2 * qwen3.d_head();  // H Dh = 2 D
  out.emplace_back("qwen3 q/k norms, head_dim", qwen3);
  // gpt-oss: windowed and full layers alternating (each step's window is its layer's), sinks,
  // fractional YaRN
  ModelConfig gpt_oss = variants;
  gpt_oss.embeddings.positional = Positional::rope;
  gpt_oss.attention.sliding_window = 3;
  gpt_oss.attention.layer_types = {LayerAttention::full, LayerAttention::sliding};
  gpt_oss.attention.rope_base = 100.0;
  gpt_oss.attention.rope_scaling = {
      .type = RopeScalingType::yarn, .factor = 4.0, .original_max_len = 64, .truncate = false};
  out.emplace_back("gpt-oss layer types, fractional yarn", gpt_oss);
  // DeepSeek-V3's latent attention: each step projects its token's latents, rotates its q and its
  // shared RoPE key at its own position, and appends the expanded k and the narrower v
  ModelConfig mla = llama;
  mla.attention.num_kv_heads.reset();
  mla.attention.kv_lora_rank = 3;
  mla.attention.q_lora_rank = 5;
  mla.attention.qk_nope_head_dim = 2;
  mla.attention.qk_rope_head_dim = 4;
  mla.attention.v_head_dim = 3;
  mla.attention.rope_style = RopeStyle::interleaved;
  mla.attention.rope_scaling.mscale = 1.0;
  mla.attention.rope_scaling.mscale_all_dim = 1.0;
  out.emplace_back("deepseek-v3 latent attention", mla);
  // a mixture of experts: each step routes its new tokens as the full pass routes every position
  ModelConfig moe = moe_like(out[1].second);
  out.emplace_back("moe deepseek-style, a dense first layer", moe);
  return out;
}

template <class Real>
class Generate : public ::testing::Test {};
TYPED_TEST_SUITE(Generate, test::Dtypes);

TYPED_TEST(Generate, EachStepsLogitsAreTheFullForwardsAtItsPosition) {
  using Real = TypeParam;
  const index_t steps = 5;
  const std::vector<std::int64_t> prompt_lengths = {0, 1, 7};
  ScopedSettings keep;
  for (const auto& [what, cfg] : configs()) {
    const auto params = test::convert_params<Real>(Params<double>::init(cfg, 11));
    const Batch prompt = Batch::random(cfg, 3, 7, 4, prompt_lengths);
    for (Backend be : {Backend::reference, Backend::simd}) {
      set_backend(be);
      const std::string where = what + " on " + to_string(be);
      const Generation<Real> g = generate(params, prompt, {.steps = steps, .start_token = 2});
      ASSERT_EQ(g.tokens.size(), static_cast<std::size_t>(steps)) << where;
      // the full sequences: each prompt, then the tokens fed at steps 0 .. T - 1
      Batch full;
      full.batch = 3;
      full.seq_len = 7 + steps;
      full.tokens.assign(static_cast<std::size_t>(full.batch * full.seq_len), 0);
      for (index_t b = 0; b < 3; ++b) {
        const index_t p = prompt_lengths[static_cast<std::size_t>(b)];
        full.lengths.push_back(p + steps);
        for (index_t s = 0; s < p; ++s)
          full.tokens[static_cast<std::size_t>(b * full.seq_len + s)] =
              prompt.tokens[static_cast<std::size_t>(b * prompt.seq_len + s)];
        for (index_t t = 0; t < steps; ++t)
          full.tokens[static_cast<std::size_t>(b * full.seq_len + p + t)] =
              g.tokens[static_cast<std::size_t>(t)][static_cast<std::size_t>(b)];
      }
      Activations<Real> acts;
      forward(params, full, acts, {.train = false});
      const index_t V = cfg.embeddings.vocab_size;
      double worst = 0, scale = 0;
      for (index_t t = 0; t < steps; ++t) {
        for (index_t b = 0; b < 3; ++b) {
          const index_t p = prompt_lengths[static_cast<std::size_t>(b)];
          const Real* want = acts.lm_logits.data() + (b * full.seq_len + p + t) * V;
          const Real* got = g.logits[static_cast<std::size_t>(t)].data() + b * V;
          for (index_t c = 0; c < V; ++c) {
            worst = std::max(worst, std::abs(static_cast<double>(got[c] - want[c])));
            scale = std::max(scale, std::abs(static_cast<double>(want[c])));
          }
          // greedy: the next step feeds this step's first largest logit
          if (t + 1 < steps) {
            index_t best = 0;
            for (index_t c = 1; c < V; ++c) best = got[c] > got[best] ? c : best;
            EXPECT_EQ(g.tokens[static_cast<std::size_t>(t + 1)][static_cast<std::size_t>(b)], best)
                << where;
          }
        }
      }
      const double tol = std::is_same_v<Real, float> ? 2e-5 : 1e-13;
      EXPECT_LE(worst, tol * std::max(scale, 1.0)) << where << ": worst " << worst;
      if (be == Backend::simd) {
        EXPECT_EQ(worst, 0.0) << where << ": not bitwise";
      }
      // step 0 feeds the prompt's greedy next token, or the start token after an empty prompt
      EXPECT_EQ(g.tokens[0][0], 2) << where;
      for (index_t b = 1; b < 3; ++b) {
        const index_t p = prompt_lengths[static_cast<std::size_t>(b)];
        const Real* z = acts.lm_logits.data() + (b * full.seq_len + p - 1) * V;
        index_t best = 0;
        for (index_t c = 1; c < V; ++c) best = z[c] > z[best] ? c : best;
        EXPECT_EQ(g.tokens[0][static_cast<std::size_t>(b)], best) << where;
      }
    }
  }
}

// Teacher forcing: fed its own greedy tokens, generation gives the same bits; fed other tokens,
// each step's logits are still the full forward's on the sequence grown by them.
TEST(Generate, FedTokensAreTeacherForced) {
  const ModelConfig cfg = configs()[1].second;  // LLaMA style
  const auto params = Params<double>::init(cfg, 2);
  const Batch prompt = Batch::random(cfg, 2, 5, 3, {5, 0});
  const auto greedy = generate(params, prompt, {.steps = 4});
  const auto same = generate(params, prompt, {.steps = 4, .feed = &greedy.tokens});
  for (std::size_t t = 0; t < 4; ++t) {
    EXPECT_EQ(std::memcmp(greedy.logits[t].data(), same.logits[t].data(),
                          static_cast<std::size_t>(greedy.logits[t].numel()) * sizeof(double)),
              0);
  }
  const std::vector<std::vector<std::int64_t>> feed = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
  const auto forced = generate(params, prompt, {.steps = 4, .feed = &feed});
  EXPECT_EQ(forced.tokens, feed);
  Batch full;
  full.batch = 2;
  full.seq_len = 9;
  full.tokens.assign(18, 0);
  full.lengths = {9, 4};
  for (index_t s = 0; s < 5; ++s) full.tokens[static_cast<std::size_t>(s)] = prompt.tokens[s];
  for (index_t t = 0; t < 4; ++t) {
    full.tokens[static_cast<std::size_t>(5 + t)] = feed[static_cast<std::size_t>(t)][0];
    full.tokens[static_cast<std::size_t>(9 + t)] = feed[static_cast<std::size_t>(t)][1];
  }
  Activations<double> acts;
  forward(params, full, acts, {.train = false});
  const index_t V = cfg.embeddings.vocab_size;
  for (index_t t = 0; t < 4; ++t) {
    for (index_t b = 0; b < 2; ++b) {
      const index_t p = b == 0 ? 5 : 0;
      for (index_t c = 0; c < V; ++c) {
        EXPECT_NEAR(forced.logits[static_cast<std::size_t>(t)][b * V + c],
                    acts.lm_logits[(b * 9 + p + t) * V + c], 1e-12);
      }
    }
  }
  const std::vector<std::vector<std::int64_t>> short_feed = {{1, 2}};
  EXPECT_THROW(generate(params, prompt, {.steps = 4, .feed = &short_feed}), ShapeError);
  const std::vector<std::vector<std::int64_t>> bad = {{1, 2}, {3, 99}, {5, 6}, {7, 8}};
  EXPECT_THROW(generate(params, prompt, {.steps = 4, .feed = &bad}), InputError);
}

TEST(Generate, BadRequestsAreNamedErrors) {
  ModelConfig enc;
  const auto ep = Params<double>::init(enc, 1);
  EXPECT_THROW(generate(ep, Batch::random(enc, 1, 3, 1), {.steps = 1}), ConfigError);
  const ModelConfig cfg = configs()[0].second;
  const auto p = Params<double>::init(cfg, 1);
  const Batch prompt = Batch::random(cfg, 2, 4, 1, {4, 2});
  EXPECT_THROW(generate(p, prompt, {.steps = 13}), ShapeError) << "4 + 13 > max_len 16";
  EXPECT_THROW(generate(p, prompt, {.steps = -1}), ConfigError);
  EXPECT_THROW(generate(p, prompt, {.steps = 1, .start_token = 23}), InputError);
  EXPECT_TRUE(generate(p, prompt, {.steps = 0}).logits.empty());
}

}  // namespace
}  // namespace teo
