// Harness 3: shapes. The bytes become a config and a batch, including invalid and extreme sizes.
// Either validation rejects them with a named teo::Error before anything is allocated, or (when
// the pass is small enough to run quickly) forward and backward run on every backend and agree
// with the reference backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_util.hpp"
#include "teo/backend.hpp"
#include "teo/model.hpp"

namespace {

// One backend's results: loss, logits and every parameter gradient; and, under max pooling, the
// positions it chose and the (B, S, D) tensor it pooled over.
struct Result {
  std::vector<double> values;
  std::vector<std::int64_t> argmax;
  std::vector<double> pooled_from;
};

// Runs forward and backward on one backend (on `threads` threads, 0: the current count).
Result run(const teo::Params<double>& params, const teo::Batch& batch, teo::Backend backend,
           std::uint64_t seed, int threads = 0) {
  teo::ScopedSettings keep;
  teo::set_backend(backend);
  if (threads > 0) teo::set_num_threads(threads);
  teo::Activations<double> acts, dacts;
  teo::Params<double> grads;
  teo::forward(params, batch, acts, {.train = true, .dropout_seed = seed});
  teo::backward(params, batch, acts, grads, dacts);
  Result r;
  r.values.assign(acts.logits.begin(), acts.logits.end());
  r.values.push_back(acts.loss[0]);
  grads.visit([&](const std::string&, const teo::Tensor<double>& t) {
    r.values.insert(r.values.end(), t.begin(), t.end());
  });
  r.argmax = acts.pool_argmax;
  const teo::Tensor<double>& top = params.config.norms.norm_first ? acts.final_norm
                                   : acts.layers.empty()          ? acts.input
                                                                  : acts.layers.back().output;
  r.pooled_from.assign(top.begin(), top.end());
  return r;
}

// The largest difference between a and b over their first n values, and the largest magnitude in
// a there.
std::pair<double, double> difference(const std::vector<double>& a, const std::vector<double>& b,
                                     std::size_t n) {
  double scale = 1e-300, err = 0;
  for (std::size_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::abs(a[i]));
    err = std::max(err, std::abs(b[i] - a[i]));
  }
  return {err, scale};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The fuzzer's memory budget: anything larger must be rejected by validation, by name.
  static const bool limited = [] {
    teo::set_memory_limits(
        {.max_tensor_elements = teo::index_t{1} << 22, .max_total_bytes = 64 << 20});
    return true;
  }();
  (void)limited;
  teo::fuzz::Bytes in(data, size);
  teo::ModelConfig cfg;
  cfg.embeddings.vocab_size = in.pick(1, 40);
  cfg.embeddings.max_len = in.pick(1, 24);
  cfg.attention.num_heads = in.pick(1, 4);
  // d_model a multiple of num_heads, sometimes plus 1 (indivisible), saturating on overflow.
  std::int64_t d_model = 0;
  if (__builtin_mul_overflow(cfg.attention.num_heads, in.pick(1, 5), &d_model))
    d_model = INT64_MAX - 1;
  cfg.d_model = d_model + (in.byte() == 7 ? 1 : 0);
  cfg.ffn.d_ff = in.pick(1, 24);
  cfg.num_layers = in.pick(0, 3);
  cfg.head.num_classes = in.pick(1, 6);
  cfg.norms.norm_first = in.flag();
  cfg.attention.causal = in.flag();
  cfg.embeddings.embed_scale = in.flag();
  cfg.ffn.activation = static_cast<teo::Activation>(in.byte() % 3);
  cfg.head.pooling = static_cast<teo::Pooling>(in.byte() % 3);
  cfg.embeddings.positional = static_cast<teo::Positional>(in.byte() % 5);
  // The attention variants, with their invalid values (validation must name each).
  if (in.flag()) cfg.attention.num_kv_heads = in.pick(0, 4);
  if (cfg.embeddings.positional == teo::Positional::rope) {
    cfg.attention.rope_style = in.flag() ? teo::RopeStyle::interleaved : teo::RopeStyle::neox;
    if (in.flag()) cfg.attention.rotary_dim = in.pick(-2, 10);
    if (in.byte() == 3) cfg.attention.rope_base = in.real01() * 4;  // below 1 now and then
    cfg.attention.rope_scaling.type = static_cast<teo::RopeScalingType>(in.byte() % 4);
    if (cfg.attention.rope_scaling.type != teo::RopeScalingType::none) {
      cfg.attention.rope_scaling.factor = 0.5 + in.real01() * 8;  // below 1 now and then
      if (cfg.attention.rope_scaling.type != teo::RopeScalingType::linear && in.flag())
        cfg.attention.rope_scaling.original_max_len = in.pick(0, 30);
      if (cfg.attention.rope_scaling.type == teo::RopeScalingType::yarn && in.flag()) {
        cfg.attention.rope_scaling.beta_fast = in.real01() * 64;
        cfg.attention.rope_scaling.beta_slow = in.real01() * 2;
      }
    }
  }
  if (cfg.embeddings.positional == teo::Positional::alibi && in.flag())
    cfg.attention.alibi_max_bias = in.real01() * 16 - 1;
  if (in.flag()) cfg.embeddings.position_offset = in.pick(0, 200000);
  if (in.flag()) cfg.attention.sliding_window = in.pick(0, 30);
  if (in.flag()) cfg.attention.attn_logit_softcap = in.byte() == 2 ? -1.0 : in.real01() * 5;
  cfg.attention.attn_sinks = in.flag();
  cfg.dropout = in.byte() < 200 ? 0.0 : in.real01() * 1.1;
  cfg.head.label_smoothing = in.byte() < 200 ? 0.0 : in.real01() * 1.1;
  cfg.norms.layer_norm_eps = in.byte() == 0 ? -1.0 : 1e-5;
  const std::int64_t B = in.pick(0, 4);
  std::int64_t S = in.pick(1, 24);
  std::vector<std::int64_t> lengths;
  if (in.flag() && B >= 0 && B <= 64 && S >= 0 && S <= 64) {
    for (std::int64_t b = 0; b < B; ++b) lengths.push_back(in.pick(0, S));
  }
  const std::uint64_t seed = in.u64();
  // The real encoders' keys (semantics 18), read after the rest so that older inputs keep their
  // configs; valid for architecture "encoder" only, which this harness builds.
  if (in.flag()) cfg.embeddings.type_vocab_size = in.pick(0, 3);
  cfg.embeddings.embedding_norm = in.flag();
  if (in.flag()) cfg.head.pooler = teo::Pooler::dense_tanh;
  // ViT's images (semantics 18.5), with invalid sizes now and then; usually with the sequence and
  // max_len they imply, so that valid ones run.
  if (in.byte() >= 192) {
    cfg.embeddings.input = teo::InputKind::patches;
    cfg.embeddings.image_size = in.pick(0, 12);
    cfg.embeddings.patch_size = in.pick(0, 6);
    cfg.embeddings.channels = in.pick(0, 3);
    if (cfg.embeddings.patch_size > 0 &&
        cfg.embeddings.image_size % cfg.embeddings.patch_size == 0 && in.byte() < 224) {
      cfg.embeddings.max_len = 1 + cfg.patches();
      S = cfg.embeddings.max_len;
      lengths.clear();
      cfg.embeddings.embed_scale = false;
      cfg.embeddings.type_vocab_size.reset();
      cfg.embeddings.position_offset = 0;
    }
  }
  // Qwen3's q/k norms and heads apart from d_model (head_dim, invalid now and then), read last
  // for the same reason.
  cfg.attention.qk_norm = in.flag();
  if (in.byte() >= 200) cfg.attention.head_dim = in.pick(-1, 9);
  // gpt-oss's per-layer attention (a wrong count now and then) and YaRN's fractional range
  if (in.byte() >= 200) {
    const std::int64_t n = cfg.num_layers + (in.byte() == 9 ? 1 : 0);
    for (std::int64_t i = 0; i < n && i < 8; ++i)
      cfg.attention.layer_types.push_back(in.flag() ? teo::LayerAttention::sliding
                                                    : teo::LayerAttention::full);
  }
  if (in.byte() >= 224) cfg.attention.rope_scaling.truncate = false;
  // DeepSeek's latent attention (its widths invalid now and then; valid only without biases and
  // with rope) and YaRN's mscale pair
  if (in.byte() >= 200) {
    cfg.attention.kv_lora_rank = in.pick(-1, 6);
    if (in.flag()) cfg.attention.q_lora_rank = in.pick(0, 6);
    cfg.attention.qk_nope_head_dim = in.pick(-1, 4);
    cfg.attention.qk_rope_head_dim = in.pick(0, 4);
    cfg.attention.v_head_dim = in.pick(0, 5);
    if (in.flag()) cfg.attention.attn_bias = false;
    if (in.flag()) cfg.attention.head_dim.reset();
  }
  if (in.byte() >= 224) {
    cfg.attention.rope_scaling.mscale = in.real01() * 2;
    cfg.attention.rope_scaling.mscale_all_dim = in.real01() * 2;
  }
  // Validation first: it allocates nothing, and every input goes through it.
  try {
    cfg.validate();
    teo::validate_batch_shape(cfg, {B, S}, sizeof(double));
  } catch (const teo::Error&) {
    return 0;
  }
  // This harness is about shape handling, not throughput: a valid input whose forward pass needs
  // more than kMaxWork multiply-adds is not run. Forward, backward, three backends (and a serial
  // rerun for deep models) then stay near a millisecond under ASan, so the fuzzer stays fast and
  // never writes slow units. The bound covers every size the unit tests and goldens exercise.
  constexpr double kMaxWork = 1 << 16;
  const double N = static_cast<double>(B) * static_cast<double>(S);
  const double D = static_cast<double>(cfg.d_model), F = static_cast<double>(cfg.ffn.d_ff);
  // A layer also costs a fixed amount whatever its size (some thirty tensors and calls, each
  // slow under the sanitizers), counted as kLayerCost multiply-adds: it caps the depth at 16.
  constexpr double kLayerCost = 1 << 12;
  const double work =
      static_cast<double>(cfg.num_layers) *
          (kLayerCost + N * (4 * D * D + 2 * D * F) + 2 * N * static_cast<double>(S) * D) +
      N * D + static_cast<double>(B) * D * static_cast<double>(cfg.head.num_classes) +
      N * D *
          static_cast<double>(cfg.embeddings.channels * cfg.embeddings.patch_size *
                              cfg.embeddings.patch_size);
  if (work > kMaxWork) return 0;
  teo::Params<double> params;
  teo::Batch batch;
  try {
    params = teo::Params<double>::init(cfg, seed);
    batch = teo::Batch::random(cfg, B, S, seed, lengths);
  } catch (const teo::Error&) {
    return 0;  // rejected by name before anything was allocated
  }
  // Corrupt a token or label now and then: validation must name it.
  if (in.byte() == 9 && !batch.tokens.empty()) batch.tokens[0] = cfg.embeddings.vocab_size;
  if (in.byte() == 9 && !batch.labels.empty()) batch.labels[0] = -1;
  if (in.byte() == 9 && !batch.token_types.empty()) batch.token_types[0] = -1;
  if (in.byte() == 9 && !batch.pixels.empty()) batch.pixels[0] = NAN;
  Result ref;
  try {
    ref = run(params, batch, teo::Backend::reference, seed);
  } catch (const teo::InputError&) {
    return 0;
  }
  for (double v : ref.values) teo::fuzz::require(std::isfinite(v), "reference results are finite");
  for (teo::Backend be : {teo::Backend::simd, teo::Backend::blas}) {
    const Result got = run(params, batch, be, seed);
    teo::fuzz::require(got.values.size() == ref.values.size(), "same number of results");
    // The backends differ by rounding (fused chains), and each layer can amplify a difference:
    // LayerNorm over d_model 2 multiplies it by up to 1/sqrt(eps). So agreement to 1e-9 is a
    // property of shallow models only; deeper ones (the fuzzer found 32768 layers of d_model 2
    // differing by 1e4 relative in an early layer's gradient) must still run without error.
    if (cfg.num_layers <= 2) {
      std::size_t compared = ref.values.size();
      if (got.argmax != ref.argmax) {
        // Max pooling's gradient jumps where two positions tie, and a near tie (values equal to
        // rounding; the fuzzer found them under heavy dropout) may go either way on another
        // backend. Then every differing choice must be such a tie, and only the forward results
        // (logits and loss), which are continuous there, must agree.
        const auto [top_err, top_scale] =
            difference(ref.pooled_from, got.pooled_from, ref.pooled_from.size());
        teo::fuzz::require(top_err <= 1e-9 * top_scale, "the pooled tensors agree");
        for (std::size_t i = 0; i < ref.argmax.size(); ++i) {
          if (ref.argmax[i] == got.argmax[i]) continue;
          const std::int64_t b = static_cast<std::int64_t>(i) / cfg.d_model;
          const std::int64_t c = static_cast<std::int64_t>(i) % cfg.d_model;
          const auto at = [&](std::int64_t s) {
            return ref.pooled_from[static_cast<std::size_t>((b * S + s) * cfg.d_model + c)];
          };
          teo::fuzz::require(std::abs(at(ref.argmax[i]) - at(got.argmax[i])) <= 1e-9 * top_scale,
                             "max pooling chose differently only at a near tie");
        }
        compared = static_cast<std::size_t>(B * cfg.head.num_classes + 1);
      }
      const auto [err, scale] = difference(ref.values, got.values, compared);
      teo::fuzz::require(err <= 1e-9 * scale,
                         std::string(teo::to_string(be)) + " agrees with the reference");
    } else if (be == teo::Backend::simd) {
      // What holds at any depth: the same bits on one thread as on the current count.
      const Result serial = run(params, batch, be, seed, 1);
      teo::fuzz::require(serial.values.size() == got.values.size() &&
                             std::memcmp(serial.values.data(), got.values.data(),
                                         got.values.size() * sizeof(double)) == 0,
                         "deep model: simd gives the same bits on 1 thread");
    }
  }
  return 0;
}
