// Reduced-precision emulation of the whole encoder (docs/semantics.md, "Reduced precision"): every
// named tensor is stored in the format, the error against float64 has the format's size, the bits
// are the same on every thread count and ISA, and bad requests are named errors.
#include <cmath>
#include <cstring>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/precision.hpp"
#include "teo/rounding.hpp"

namespace teo {
namespace {

ModelConfig precision_config(bool pre) {
  ModelConfig c;
  c.embeddings.vocab_size = 50;
  c.embeddings.max_len = 40;
  c.d_model = 32;
  c.attention.num_heads = 4;
  c.ffn.d_ff = 72;
  c.num_layers = 2;
  c.norms.norm_first = pre;
  c.ffn.activation = pre ? Activation::gelu_tanh : Activation::gelu;
  c.attention.causal = pre;
  c.dropout = 0.1;
  c.head.label_smoothing = 0.1;
  c.head.pooling = Pooling::mean;
  c.head.num_classes = 5;
  return c;
}

struct Pass {
  Activations<float> acts, dacts;
  Params<float> grads;
};

Pass run(const Params<float>& p, const Batch& b, Precision prec) {
  Pass r;
  forward(p, b, r.acts, {.dropout_seed = 17, .precision = prec});
  backward(p, b, r.acts, r.grads, r.dacts, {.precision = prec});
  return r;
}

bool same_bits(const Pass& a, const Pass& b) {
  bool same = test::bitwise_equal(a.acts, b.acts) && test::bitwise_equal(a.dacts, b.dacts);
  std::vector<const Tensor<float>*> ga;
  a.grads.visit([&](const std::string&, const Tensor<float>& t) { ga.push_back(&t); });
  std::size_t i = 0;
  b.grads.visit([&](const std::string&, const Tensor<float>& t) {
    same = same && i < ga.size() &&
           std::memcmp(ga[i]->data(), t.data(), sizeof(float) * t.numel()) == 0;
    ++i;
  });
  return same && i == ga.size();
}

// Whether every value of v is a value of the format (rounding leaves it alone).
bool representable(const std::vector<double>& v, Precision p) {
  for (double x : v) {
    const auto f = static_cast<float>(x);
    if (!std::isnan(f) && round_to(p, f) != f) return false;
  }
  return true;
}

class Precisions : public ::testing::Test {
 protected:
  ScopedSettings restore_;
};

TEST_F(Precisions, Bf16AndFp16StoreEveryNamedTensorInTheFormat) {
  for (Precision prec : {Precision::bf16, Precision::fp16}) {
    const ModelConfig c = precision_config(false);
    auto p = Params<float>::init(c, 3);
    round_params(p, prec);
    const Batch b = Batch::random(c, 3, 17, 4, {17, 5, 0});
    const Pass r = run(p, b, prec);
    for (const auto& [n, v] : test::named(r.acts))
      EXPECT_TRUE(representable(v, prec)) << to_string(prec) << " act." << n;
    for (const auto& [n, v] : test::named(r.dacts))
      EXPECT_TRUE(representable(v, prec)) << to_string(prec) << " grad.act." << n;
    for (const auto& [n, v] : test::named(r.grads))
      EXPECT_TRUE(representable(v, prec)) << to_string(prec) << " grad." << n;
  }
}

// Against the float64 pass on the same (rounded) parameters, each precision's error relative to
// the tensor's scale is of the order of its unit roundoff: above fp32's, and within a small
// multiple of its own u.
TEST_F(Precisions, ErrorAgainstFloat64HasTheFormatsSize) {
  const ModelConfig c = precision_config(true);
  const Batch b = Batch::random(c, 3, 17, 4, {17, 5, 0});
  for (Precision prec : {Precision::fp32, Precision::tf32, Precision::bf16, Precision::fp16}) {
    auto p = Params<float>::init(c, 3);
    round_params(p, prec);
    const Pass r = run(p, b, prec);
    const auto p64 = test::convert_params<double>(p);
    Activations<double> a64, d64;
    Params<double> g64;
    forward(p64, b, a64, {.dropout_seed = 17});
    backward(p64, b, a64, g64, d64);
    const auto want = test::named(a64);
    double worst = 0;
    for (const auto& [n, v] : test::named(r.acts)) {
      if (n == "loss") continue;  // a scalar: its relative error is not a tensor's
      worst = std::max(worst, test::compare(v, want.at(n)));
    }
    const double u = unit_roundoff(prec);
    EXPECT_LT(worst, 64 * u) << to_string(prec);
    if (prec != Precision::fp32) {
      EXPECT_GT(worst, 0.25 * u) << to_string(prec);
    }
  }
}

TEST_F(Precisions, EmulationIsBitwiseDeterministicAcrossThreadsAndIsas) {
  for (Precision prec : {Precision::tf32, Precision::bf16, Precision::fp16}) {
    for (bool pre : {false, true}) {
      const ModelConfig c = precision_config(pre);
      auto p = Params<float>::init(c, 5);
      round_params(p, prec);
      const Batch b = Batch::random(c, 5, 33, 6, {33, 2, 0, 33, 17});
      set_backend(Backend::simd);
      set_isa(Isa::scalar);
      set_num_threads(1);
      const Pass want = run(p, b, prec);
      for (Isa i : supported_isas()) {
        set_isa(i);
        for (int t : {2, 7}) {
          set_num_threads(t);
          EXPECT_TRUE(same_bits(run(p, b, prec), want))
              << to_string(prec) << " " << to_string(i) << " threads=" << t;
        }
      }
      // the reference backend is deterministic too, across thread counts
      set_backend(Backend::reference);
      set_num_threads(1);
      const Pass ref = run(p, b, prec);
      set_num_threads(2);
      EXPECT_TRUE(same_bits(run(p, b, prec), ref)) << to_string(prec) << " reference";
    }
  }
}

TEST_F(Precisions, EmulationChangesTheResultAndFp32IsThePlainPass) {
  const ModelConfig c = precision_config(false);
  const auto p = Params<float>::init(c, 5);
  const Batch b = Batch::random(c, 2, 9, 6);
  Pass plain;
  forward(p, b, plain.acts, {.dropout_seed = 17});
  backward(p, b, plain.acts, plain.grads, plain.dacts);
  EXPECT_TRUE(same_bits(run(p, b, Precision::fp32), plain));
  for (Precision prec : {Precision::tf32, Precision::bf16, Precision::fp16})
    EXPECT_FALSE(same_bits(run(p, b, prec), plain)) << to_string(prec);
}

TEST_F(Precisions, Fp16OverflowIsARangeErrorNamingTheTensor) {
  const ModelConfig c = precision_config(false);
  auto p = Params<float>::init(c, 5);
  // Large query weights make the first layer's scores overflow fp16 while q itself stays finite.
  for (float& w : p.layers[0].q_weight) w *= 400.0f;
  for (float& w : p.layers[0].k_weight) w *= 400.0f;
  round_params(p, Precision::fp16);
  const Batch b = Batch::random(c, 2, 9, 6);
  Activations<float> acts;
  test::expect_throw<RangeError>([&] { forward(p, b, acts, {.precision = Precision::fp16}); },
                                 "layers.0.");
  // bf16 has float's range: the same pass is finite
  forward(p, b, acts, {.precision = Precision::bf16});
  EXPECT_TRUE(std::isfinite(acts.loss[0]));
  // a parameter beyond fp16's range is named by round_params
  auto big = Params<float>::init(c, 5);
  big.head_bias[0] = 1e6f;
  test::expect_throw<RangeError>([&] { round_params(big, Precision::fp16); },
                                 "parameter head.bias");
}

TEST_F(Precisions, APrecisionTheTypeCannotRunIsAConfigError) {
  const ModelConfig c = precision_config(false);
  const Batch b = Batch::random(c, 2, 9, 6);
  Activations<double> a64;
  test::expect_throw<ConfigError>(
      [&] { forward(Params<double>::init(c, 1), b, a64, {.precision = Precision::bf16}); },
      "precision bf16 cannot run in double");
  Activations<float> a32;
  test::expect_throw<ConfigError>(
      [&] { forward(Params<float>::init(c, 1), b, a32, {.precision = Precision::fp64}); },
      "precision fp64 cannot run in float");
  // delayed fp8 scales are a linear op case's inputs: a pass has none to take
  Fp8Recipe delayed;
  delayed.delayed = true;
  test::expect_throw<ConfigError>(
      [&] {
        forward(Params<float>::init(c, 1), b, a32, {.precision = Precision::fp8, .fp8 = delayed});
      },
      "delayed scales (fp8_scales) are inputs of the linear op case");
  // a recipe outside fp8 would be ignored: it is refused instead
  test::expect_throw<ConfigError>(
      [&] {
        forward(Params<float>::init(c, 1), b, a32,
                {.precision = Precision::bf16, .fp8 = Fp8Recipe{}});
      },
      "an fp8 recipe (the pass options' fp8) is read under precision fp8 only; this pass "
      "emulates bf16");
  test::expect_throw<ConfigError>(
      [&] { forward(Params<float>::init(c, 1), b, a32, {.fp8 = Fp8Recipe{}}); },
      "this pass emulates fp32");
}

}  // namespace
}  // namespace teo
