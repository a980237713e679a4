// The whole encoder on every backend: simd and blas against the reference on every stage's
// activation and gradient, in both dtypes; and bitwise determinism across thread counts (1, 2, 7),
// repeated runs and, for simd, forced ISAs.
#include <cstring>

#include "support.hpp"
#include "teo/backend.hpp"

namespace teo {
namespace {

ModelConfig backend_config(bool pre) {
  ModelConfig c;
  c.embeddings.vocab_size = 50;
  c.embeddings.max_len = 40;
  c.d_model = 64;
  c.attention.num_heads = 4;
  c.ffn.d_ff = 136;  // not a multiple of any register tile
  c.num_layers = 2;
  c.norms.norm_first = pre;
  c.ffn.activation = pre ? Activation::gelu_tanh : Activation::gelu;
  c.attention.causal = pre;
  c.dropout = 0.1;
  c.head.label_smoothing = 0.1;
  c.head.pooling = pre ? Pooling::max : Pooling::mean;
  c.head.num_classes = 7;
  return c;
}

// The plain post- and pre-norm layers, and two with every attention variant: GQA with RoPE
// (partial, YaRN, an offset), a window, a soft-cap and sinks, in a LLaMA block (RMSNorm, SwiGLU,
// no biases); MQA with ALiBi and a window, with a GeGLU FFN and RMSNorm after the residuals.
std::vector<ModelConfig> backend_configs() {
  ModelConfig rope = backend_config(true);
  rope.attention.num_kv_heads = 2;
  rope.embeddings.positional = Positional::rope;
  rope.attention.rotary_dim = 12;
  rope.attention.rope_scaling = {
      .type = RopeScalingType::yarn, .factor = 4.0, .original_max_len = 16};
  rope.embeddings.position_offset = 1000;
  rope.attention.sliding_window = 9;
  rope.attention.attn_logit_softcap = 2.0;
  rope.attention.attn_sinks = true;
  rope.norms.norm = Norm::rmsnorm;
  rope.ffn.kind = FfnKind::swiglu;
  rope.ffn.activation = Activation::silu;
  rope.attention.attn_bias = rope.ffn.ffn_bias = rope.head.head_bias = false;
  ModelConfig alibi = backend_config(false);
  alibi.attention.num_kv_heads = 1;
  alibi.embeddings.positional = Positional::alibi;
  alibi.attention.sliding_window = 17;
  alibi.norms.norm = Norm::rmsnorm;
  alibi.ffn.kind = FfnKind::geglu;
  return {backend_config(false), backend_config(true), rope, alibi};
}

template <class Real>
struct Run {
  Activations<Real> acts, dacts;
  Params<Real> grads;
};

template <class Real>
Run<Real> run(const Params<Real>& p, const Batch& b) {
  Run<Real> r;
  forward(p, b, r.acts, {.dropout_seed = 17});
  backward(p, b, r.acts, r.grads, r.dacts);
  return r;
}

template <class Real>
bool bitwise_equal(const Params<Real>& a, const Params<Real>& b) {
  std::vector<const Tensor<Real>*> ta, tb;
  a.visit([&](const std::string&, const Tensor<Real>& t) { ta.push_back(&t); });
  b.visit([&](const std::string&, const Tensor<Real>& t) { tb.push_back(&t); });
  for (std::size_t i = 0; i < ta.size(); ++i)
    if (std::memcmp(ta[i]->data(), tb[i]->data(), sizeof(Real) * ta[i]->numel()) != 0) return false;
  return ta.size() == tb.size();
}

template <class Real>
bool bitwise_equal(const Run<Real>& a, const Run<Real>& b) {
  return test::bitwise_equal(a.acts, b.acts) && test::bitwise_equal(a.dacts, b.dacts) &&
         bitwise_equal(a.grads, b.grads);
}

template <class Real>
class Backends : public ::testing::Test {
 protected:
  ScopedSettings restore_;
};
TYPED_TEST_SUITE(Backends, test::Dtypes);

// Tolerance relative to each tensor's largest magnitude (parameter gradients: to the larger of
// that and 1% of the largest gradient, since some are exactly 0 in exact arithmetic). The backends
// differ from the reference only in the GEMMs' rounding (fused multiply-add chains, OpenBLAS's
// order), a few units of roundoff per product of length <= 136, amplified by two layers.
TYPED_TEST(Backends, SimdAndBlasMatchTheReferenceOnEveryStage) {
  using Real = TypeParam;
  const double tol = std::is_same_v<Real, float> ? 2e-4 : 1e-11;
  for (const ModelConfig& c : backend_configs()) {
    const bool pre = c.norms.norm_first;
    auto p = Params<Real>::init(c, 3);
    const Batch b = Batch::random(c, 6, 33, 4, {33, 1, 0, 20, 33, 7});
    set_backend(Backend::reference);
    const Run<Real> want = run(p, b);
    const auto wa = test::named(want.acts), wd = test::named(want.dacts);
    const auto wg = test::named(want.grads);
    double largest = 0;
    for (const auto& [n, v] : wg)
      for (double x : v) largest = std::max(largest, std::abs(x));
    for (Backend be : {Backend::simd, Backend::blas}) {
      set_backend(be);
      const Run<Real> got = run(p, b);
      const std::string tag = std::string(to_string(be)) + (pre ? " pre-norm " : " post-norm ") +
                              to_string(c.embeddings.positional) + " ";
      for (const auto& [n, v] : test::named(got.acts))
        EXPECT_LE(test::compare(v, wa.at(n)), tol) << tag << "act." << n;
      for (const auto& [n, v] : test::named(got.dacts))
        EXPECT_LE(test::compare(v, wd.at(n)), tol) << tag << "grad.act." << n;
      for (const auto& [n, v] : test::named(got.grads))
        EXPECT_LE(test::compare(v, wg.at(n), 1e-2 * largest), tol) << tag << "grad." << n;
    }
  }
}

TYPED_TEST(Backends, EveryBackendIsBitwiseDeterministicAcrossThreadCounts) {
  using Real = TypeParam;
  const auto configs = backend_configs();
  for (const ModelConfig& c : {configs[0], configs[2], configs[3]}) {
    const auto p = Params<Real>::init(c, 5);
    const Batch b = Batch::random(c, 6, 33, 6, {33, 2, 0, 33, 17, 9});
    for (Backend be : {Backend::reference, Backend::simd, Backend::blas}) {
      set_backend(be);
      set_num_threads(1);
      const Run<Real> want = run(p, b);
      for (int t : {2, 7, 2}) {
        set_num_threads(t);
        EXPECT_TRUE(bitwise_equal(run(p, b), want))
            << to_string(be) << " threads=" << t << " " << to_string(c.embeddings.positional);
      }
    }
  }
}

TYPED_TEST(Backends, SimdIsBitwiseIdenticalAcrossIsas) {
  using Real = TypeParam;
  for (const ModelConfig& c : backend_configs()) {
    const auto p = Params<Real>::init(c, 7);
    const Batch b = Batch::random(c, 5, 40, 8, {40, 3, 0, 39, 12});
    set_backend(Backend::simd);
    set_isa(Isa::scalar);
    const Run<Real> want = run(p, b);
    for (Isa i : supported_isas()) {
      set_isa(i);
      set_num_threads(2);
      EXPECT_TRUE(bitwise_equal(run(p, b), want))
          << to_string(i) << " " << to_string(c.embeddings.positional);
    }
  }
}

// ScopedSettings restores on any path and never throws from its destructor: destroyed inside a
// parallel region, where the setters refuse to run, it leaves the settings as they are.
TEST(ScopedSettings, RestoresAndNeverThrowsFromItsDestructor) {
  static_assert(std::is_nothrow_destructible_v<ScopedSettings>);
  ScopedSettings outer;
  set_backend(Backend::simd);
  set_num_threads(2);
  {
    ScopedSettings inner;
    set_backend(Backend::reference);
    set_num_threads(3);
  }
  EXPECT_EQ(backend(), Backend::simd);
  EXPECT_EQ(num_threads(), 2);
  parallel_tasks(2, [](std::int64_t) {
    ScopedSettings inside;  // its destructor runs in the region: no throw, no terminate
  });
  EXPECT_EQ(backend(), Backend::simd);
  EXPECT_EQ(num_threads(), 2);
}

}  // namespace
}  // namespace teo
