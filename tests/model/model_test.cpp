#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "support.hpp"
#include "teo/backend.hpp"

namespace teo {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.embeddings.vocab_size = 13;
  c.embeddings.max_len = 9;
  c.d_model = 12;
  c.attention.num_heads = 3;
  c.ffn.d_ff = 20;
  c.num_layers = 2;
  c.head.num_classes = 5;
  return c;
}

template <class Real>
class Model : public ::testing::Test {};
TYPED_TEST_SUITE(Model, test::Dtypes);

TYPED_TEST(Model, EveryStageHasItsShape) {
  using Real = TypeParam;
  for (bool pre : {false, true}) {
    ModelConfig c = small_config();
    c.norms.norm_first = pre;
    const auto p = Params<Real>::init(c, 1);
    const Batch batch = Batch::random(c, 3, 7, 2, {7, 3, 0});
    Activations<Real> a;
    forward(p, batch, a);
    EXPECT_EQ(a.embedding.shape(), Shape({3, 7, 12}));
    EXPECT_EQ(a.positional.shape(), Shape({7, 12}));
    for (const auto& l : a.layers) {
      EXPECT_EQ(l.q.shape(), Shape({3, 3, 7, 4}));
      EXPECT_EQ(l.scores.shape(), Shape({3, 3, 7, 7}));
      EXPECT_EQ(l.probs.shape(), Shape({3, 3, 7, 7}));
      EXPECT_EQ(l.context.shape(), Shape({3, 7, 12}));
      EXPECT_EQ(l.ffn_hidden.shape(), Shape({3, 7, 20}));
      EXPECT_EQ(l.output.shape(), Shape({3, 7, 12}));
    }
    EXPECT_EQ(a.final_norm.absent(), !pre);
    EXPECT_EQ(a.pooled.shape(), Shape({3, 12}));
    EXPECT_EQ(a.logits.shape(), Shape({3, 5}));
    EXPECT_EQ(a.loss.numel(), 1);
    Params<Real> g;
    Activations<Real> da;
    backward(p, batch, a, g, da);
    // gradients mirror what they differentiate
    auto ga = test::named(da);
    for (const auto& [name, v] : test::named(a)) EXPECT_EQ(ga.at(name).size(), v.size()) << name;
    auto gp = test::named(g);
    for (const auto& [name, v] : test::named(p)) EXPECT_EQ(gp.at(name).size(), v.size()) << name;
  }
}

// forward and backward reuse the buffers of the activations, gradients and masks they are given.
// Nothing of an earlier pass may show through: a pass after a larger batch with dropout, and an
// evaluation pass after a training pass, give the bits of a pass on fresh objects.
// The forward pass shapes its activations without zero-filling them (Tensor::reset_for_overwrite),
// so it must write every element: with every buffer poisoned with NaN beforehand, it still gives
// a fresh pass's bits, in both layouts, both poolings, with and without dropout, causal or not.
TYPED_TEST(Model, ForwardOverwritesEveryActivation) {
  using Real = TypeParam;
  for (bool pre : {false, true}) {
    for (bool causal : {false, true}) {
      ModelConfig c = small_config();
      c.norms.norm_first = pre;
      c.attention.causal = causal;
      c.head.pooling = causal ? Pooling::max : Pooling::mean;
      c.dropout = pre ? 0.25 : 0.0;
      const auto p = Params<Real>::init(c, 5);
      const Batch batch = Batch::random(c, 3, 7, 8, {7, 2, 5});
      const ForwardOptions fo{.train = true, .dropout_seed = 3};
      Activations<Real> a, fresh;
      forward(p, batch, a, fo);
      a.visit([](const std::string&, Tensor<Real>& t) {
        t.fill(std::numeric_limits<Real>::quiet_NaN());
      });
      forward(p, batch, a, fo);
      forward(p, batch, fresh, fo);
      EXPECT_TRUE(test::bitwise_equal(a, fresh)) << "pre " << pre << " causal " << causal;
      EXPECT_EQ(test::named(a), test::named(fresh));  // names the tensor when the bits differ
    }
  }
}

// Backward leaves every layer activation gradient unfilled for its first writer to overwrite
// (allocate, allocate_layer): whatever a reused dacts held before, NaN included, the gradients are
// those of a fresh one, on every backend, pre- and post-norm, with and without dropout and the
// causal mask.
TYPED_TEST(Model, BackwardOverwritesEveryGradientItDoesNotZero) {
  using Real = TypeParam;
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd, Backend::blas}) {
    set_backend(be);
    for (bool pre : {false, true}) {
      for (bool causal : {false, true}) {
        for (double dropout : {0.0, 0.25}) {
          ModelConfig c = small_config();
          c.norms.norm_first = pre;
          c.attention.causal = causal;
          c.dropout = dropout;
          const auto p = Params<Real>::init(c, 5);
          const Batch batch = Batch::random(c, 4, 7, 8, {7, 2, 0, 5});  // one empty sequence
          const ForwardOptions fo{.train = true, .dropout_seed = 3};
          Activations<Real> a, da, fresh_da;
          Params<Real> g, fresh_g;
          forward(p, batch, a, fo);
          backward(p, batch, a, g, da);
          da.visit([](const std::string&, Tensor<Real>& t) {
            t.fill(std::numeric_limits<Real>::quiet_NaN());
          });
          backward(p, batch, a, g, da);
          backward(p, batch, a, fresh_g, fresh_da);
          const std::string where = std::string(to_string(be)) + " pre " + std::to_string(pre) +
                                    " causal " + std::to_string(causal) + " dropout " +
                                    std::to_string(dropout);
          EXPECT_TRUE(test::bitwise_equal(da, fresh_da)) << where;
          EXPECT_EQ(test::named(da), test::named(fresh_da)) << where;
          std::vector<const Tensor<Real>*> gs, fs;
          g.visit([&](const std::string&, const Tensor<Real>& t) { gs.push_back(&t); });
          fresh_g.visit([&](const std::string&, const Tensor<Real>& t) { fs.push_back(&t); });
          ASSERT_EQ(gs.size(), fs.size());
          for (std::size_t i = 0; i < gs.size(); ++i)
            EXPECT_TRUE(gs[i]->numel() == fs[i]->numel() &&
                        std::memcmp(gs[i]->data(), fs[i]->data(),
                                    sizeof(Real) * static_cast<std::size_t>(gs[i]->numel())) == 0)
                << where << " parameter gradient " << i;
        }
      }
    }
  }
}

// The same as BackwardOverwritesEveryGradientItDoesNotZero, in the other shapes the first writers
// depend on: no layer (the input's gradient is the top of the stack), one layer, grouped-query
// attention with RoPE, bf16 storage (float only: it keeps the FFN's separate passes), the lean
// backward; and a single layer (encoder_layer_backward), whose dx and layer gradients start as
// NaN.
TYPED_TEST(Model, BackwardOverwritesInEveryShapeOfTheStack) {
  using Real = TypeParam;
  const Real nan = std::numeric_limits<Real>::quiet_NaN();
  struct Case {
    const char* name;
    index_t layers;
    bool gqa_rope;
    bool bf16;
    bool lean;
  };
  for (const Case& k :
       {Case{"no layer", 0, false, false, false}, Case{"one layer", 1, false, false, false},
        Case{"gqa + rope", 2, true, false, false}, Case{"bf16", 2, false, true, false},
        Case{"lean", 2, true, false, true}}) {
    if (k.bf16 && !std::is_same_v<Real, float>) continue;
    for (bool pre : {false, true}) {
      ModelConfig c = small_config();
      c.num_layers = k.layers;
      c.norms.norm_first = pre;
      c.dropout = 0.25;
      if (k.gqa_rope) {
        c.attention.num_kv_heads = 1;
        c.embeddings.positional = Positional::rope;
      }
      const auto p = Params<Real>::init(c, 6);
      const Batch batch = Batch::random(c, 3, 7, 9, {7, 0, 4});
      const std::optional<Precision> prec =
          k.bf16 ? std::optional<Precision>(Precision::bf16) : std::nullopt;
      const ForwardOptions fo{.train = true, .dropout_seed = 4, .precision = prec};
      const BackwardOptions bo{.precision = prec, .layer_activation_grads = !k.lean};
      Activations<Real> a, da, fresh_da;
      Params<Real> g, fresh_g;
      forward(p, batch, a, fo);
      backward(p, batch, a, g, da, bo);
      da.visit([&](const std::string&, Tensor<Real>& t) { t.fill(nan); });
      backward(p, batch, a, g, da, bo);
      backward(p, batch, a, fresh_g, fresh_da, bo);
      const std::string where = std::string(k.name) + (pre ? " pre-norm" : " post-norm");
      EXPECT_TRUE(test::bitwise_equal(da, fresh_da)) << where;
      EXPECT_EQ(test::named(da), test::named(fresh_da)) << where;
      EXPECT_TRUE(test::bitwise_equal(g, fresh_g)) << where;
    }
  }
  // One layer on its own: dx and every layer gradient of a reused dL start as NaN.
  for (bool pre : {false, true}) {
    ModelConfig c = small_config();
    c.norms.norm_first = pre;
    c.dropout = 0.25;
    const auto all = Params<Real>::init(c, 7);
    const LayerParams<Real>& P = all.layers[0];
    const std::vector<std::int64_t> lengths = {5, 0, 3};
    Tensor<Real> x({3, 5, c.d_model}), dy({3, 5, c.d_model});
    for (index_t i = 0; i < x.numel(); ++i) {
      x[i] = static_cast<Real>(std::sin(0.7 * static_cast<double>(i)));
      dy[i] = static_cast<Real>(std::cos(0.3 * static_cast<double>(i)));
    }
    LayerActs<Real> L, dL, fresh_dL;
    LayerParams<Real> G, fresh_G;
    Tensor<Real> dx, fresh_dx;
    encoder_layer_forward(c, P, x, lengths, L, {.train = true, .dropout_seed = 2});
    encoder_layer_backward(c, P, x, lengths, L, dy, dx, G, dL);
    dx.fill(nan);
    for (Tensor<Real>* t : {&dL.norm1, &dL.attn_out, &dL.residual1, &dL.norm2, &dL.ffn_out,
                            &dL.residual2, &dL.output, &dL.context, &dL.ffn_pre, &dL.ffn_hidden})
      t->fill(nan);
    encoder_layer_backward(c, P, x, lengths, L, dy, dx, G, dL);
    encoder_layer_backward(c, P, x, lengths, L, dy, fresh_dx, fresh_G, fresh_dL);
    const std::string where = pre ? "single layer, pre-norm" : "single layer, post-norm";
    EXPECT_EQ(std::memcmp(dx.data(), fresh_dx.data(), sizeof(Real) * dx.numel()), 0) << where;
    EXPECT_FALSE(std::isnan(dx[0])) << where;
    for (auto [t, f] :
         {std::pair{&dL.norm1, &fresh_dL.norm1}, std::pair{&dL.attn_out, &fresh_dL.attn_out},
          std::pair{&dL.residual1, &fresh_dL.residual1}, std::pair{&dL.norm2, &fresh_dL.norm2},
          std::pair{&dL.ffn_out, &fresh_dL.ffn_out}, std::pair{&dL.residual2, &fresh_dL.residual2},
          std::pair{&dL.ffn_hidden, &fresh_dL.ffn_hidden}})
      EXPECT_EQ(std::memcmp(t->data(), f->data(), sizeof(Real) * t->numel()), 0) << where;
    std::vector<const Tensor<Real>*> gs, fs;
    G.visit([&](const std::string&, const Tensor<Real>& t) { gs.push_back(&t); });
    fresh_G.visit([&](const std::string&, const Tensor<Real>& t) { fs.push_back(&t); });
    ASSERT_EQ(gs.size(), fs.size());
    for (std::size_t i = 0; i < gs.size(); ++i)
      EXPECT_EQ(std::memcmp(gs[i]->data(), fs[i]->data(), sizeof(Real) * gs[i]->numel()), 0)
          << where << " parameter gradient " << i;
  }
}

TYPED_TEST(Model, ReusedActivationsGiveTheBitsOfFreshOnes) {
  using Real = TypeParam;
  for (bool pre : {false, true}) {
    for (Pooling pool : {Pooling::mean, Pooling::max}) {
      ModelConfig c = small_config();
      c.norms.norm_first = pre;
      c.head.pooling = pool;
      c.dropout = 0.25;
      const auto p = Params<Real>::init(c, 4);
      const Batch big = Batch::random(c, 5, 9, 6, {9, 9, 4, 1, 7});
      const Batch small = Batch::random(c, 2, 4, 7, {4, 2});
      Activations<Real> a, da;
      Params<Real> g;
      forward(p, big, a, {.train = true, .dropout_seed = 1});
      backward(p, big, a, g, da);
      for (bool train : {true, false}) {
        const ForwardOptions fo{.train = train, .dropout_seed = 2};
        forward(p, small, a, fo);
        backward(p, small, a, g, da);
        Activations<Real> fa, fda;
        Params<Real> fg;
        forward(p, small, fa, fo);
        backward(p, small, fa, fg, fda);
        EXPECT_TRUE(test::bitwise_equal(a, fa)) << "pre " << pre << " train " << train;
        EXPECT_TRUE(test::bitwise_equal(da, fda)) << "pre " << pre << " train " << train;
        EXPECT_EQ(test::named(a), test::named(fa));  // names the tensor when the bits differ
        EXPECT_EQ(test::named(g), test::named(fg)) << "pre " << pre << " train " << train;
        EXPECT_EQ(a.input_mask, fa.input_mask);
        EXPECT_EQ(a.pool_argmax, fa.pool_argmax);
        for (std::size_t i = 0; i < a.layers.size(); ++i) {
          EXPECT_EQ(a.layers[i].masks.attn, fa.layers[i].masks.attn);
          EXPECT_EQ(a.layers[i].masks.ffn, fa.layers[i].masks.ffn);
          EXPECT_EQ(a.layers[i].masks.residual1, fa.layers[i].masks.residual1);
          EXPECT_EQ(a.layers[i].masks.residual2, fa.layers[i].masks.residual2);
        }
        EXPECT_EQ(train, !a.input_mask.empty());
      }
    }
  }
}

TYPED_TEST(Model, ParametersFollowTheConfig) {
  using Real = TypeParam;
  ModelConfig c = small_config();
  std::vector<std::string> names;
  Params<Real>::init(c, 0).visit(
      [&](const std::string& n, const Tensor<Real>&) { names.push_back(n); });
  EXPECT_EQ(names.front(), "embedding.weight");
  EXPECT_EQ(names[1], "layers.0.attn.q.weight");
  EXPECT_EQ(names.back(), "head.bias");
  EXPECT_EQ(names.size(), 1u + 2 * 16 + 2);
  c.norms.norm_first = true;
  c.embeddings.positional = Positional::learned;
  names.clear();
  Params<Real>::init(c, 0).visit(
      [&](const std::string& n, const Tensor<Real>&) { names.push_back(n); });
  EXPECT_EQ(names[1], "pos_embedding.weight");
  EXPECT_EQ(names[names.size() - 3], "final_norm.bias");
}

// The initialisation uses only integer arithmetic and correctly rounded operations, so these
// checksums hold on every machine and compiler; a change here changes every golden file.
// backward with layer_activation_grads = false (what golden generation runs) keeps of each layer's
// activation gradients only the output's, in one layer's scratch for the rest: every parameter
// gradient and every kept activation gradient has the bits of the full pass, on every backend,
// with three layers, dropout, both layouts, and GQA + RoPE (whose q_rot and k_rot gradients live in
// the scratch too); a dacts reused from a full pass gives the same bits.
TYPED_TEST(Model, BackwardKeepingOnlyLayerOutputGradientsGivesTheSameBits) {
  using Real = TypeParam;
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd, Backend::blas}) {
    set_backend(be);
    for (bool pre : {false, true}) {
      ModelConfig c = small_config();
      c.num_layers = 3;
      c.norms.norm_first = pre;
      c.dropout = 0.2;
      if (pre) {
        c.attention.num_kv_heads = 1;
        c.embeddings.positional = Positional::rope;
      }
      const auto p = Params<Real>::init(c, 9);
      const Batch batch = Batch::random(c, 3, 7, 4, {7, 3, 5});
      Activations<Real> a, full, lean, reused;
      Params<Real> g_full, g_lean, g_reused;
      forward(p, batch, a, {.train = true, .dropout_seed = 2});
      backward(p, batch, a, g_full, full);
      backward(p, batch, a, g_lean, lean, {.layer_activation_grads = false});
      backward(p, batch, a, g_reused, reused);
      backward(p, batch, a, g_reused, reused, {.layer_activation_grads = false});
      const std::string where = std::string(to_string(be)) + (pre ? " pre" : " post");
      const auto same = [](const Tensor<Real>& x, const Tensor<Real>& y) {
        return x.shape() == y.shape() &&
               (x.numel() == 0 ||
                std::memcmp(x.data(), y.data(),
                            sizeof(Real) * static_cast<std::size_t>(x.numel())) == 0);
      };
      std::vector<const Tensor<Real>*> gf, gl, gr;
      g_full.visit([&](const std::string&, const Tensor<Real>& t) { gf.push_back(&t); });
      g_lean.visit([&](const std::string&, const Tensor<Real>& t) { gl.push_back(&t); });
      g_reused.visit([&](const std::string&, const Tensor<Real>& t) { gr.push_back(&t); });
      ASSERT_EQ(gf.size(), gl.size());
      for (std::size_t i = 0; i < gf.size(); ++i) {
        EXPECT_TRUE(same(*gf[i], *gl[i])) << where << " parameter gradient " << i;
        EXPECT_TRUE(same(*gf[i], *gr[i])) << where << " parameter gradient " << i << ", reused";
      }
      for (const Activations<Real>* d : {&lean, &reused}) {
        for (auto [x, y] :
             {std::pair{&full.input, &d->input}, std::pair{&full.embedding, &d->embedding},
              std::pair{&full.pooled, &d->pooled}, std::pair{&full.logits, &d->logits},
              std::pair{&full.final_norm, &d->final_norm}})
          EXPECT_TRUE(same(*x, *y)) << where;
        ASSERT_EQ(d->layers.size(), 3u);
        for (std::size_t i = 0; i < 3; ++i) {
          EXPECT_TRUE(same(full.layers[i].output, d->layers[i].output)) << where << " layer " << i;
          EXPECT_EQ(d->layers[i].probs.numel(), 0) << "the rest is not kept";
          EXPECT_EQ(d->layers[i].ffn_hidden.numel(), 0);
        }
      }
    }
  }
}

// padding_idx (nn.Embedding's): the forward is the same, and the backward the same except that
// the pad token's embedding row gets no gradient from the lookup; a tied LM head's term still
// reaches that row, as in PyTorch.
TEST(Model, PaddingIdxRowGetsNoLookupGradientAndNothingElseChanges) {
  for (const bool decoder : {false, true}) {
    SCOPED_TRACE(decoder ? "tied decoder" : "encoder");
    ModelConfig c = small_config();
    if (decoder) {
      c.architecture = Architecture::decoder;
      c.attention.causal = true;
      c.head.tie_embeddings = true;
      c.head.head_bias = false;
      c.head.num_classes = ModelConfig{}.head.num_classes;
    }
    const auto params = Params<double>::init(c, 5);
    const Batch batch = Batch::random(c, 3, 6, 11, {6, 4, 2});
    const std::int64_t pad = batch.tokens[1];  // a token the batch uses among its real ones
    ModelConfig cp = c;
    cp.embeddings.padding_idx = pad;
    auto padded = params;
    padded.config = cp;
    Activations<double> a, ap, da, dap;
    Params<double> g, gp;
    forward(params, batch, a);
    forward(padded, batch, ap);
    EXPECT_EQ(a.loss[0], ap.loss[0]);
    backward(params, batch, a, g, da);
    backward(padded, batch, ap, gp, dap);
    const index_t D = c.d_model;
    double row = 0;
    for (index_t v = 0; v < c.embeddings.vocab_size; ++v) {
      for (index_t k = 0; k < D; ++k) {
        const double want = g.embedding_weight[v * D + k], got = gp.embedding_weight[v * D + k];
        if (v != pad) {
          ASSERT_EQ(got, want) << v << " " << k;
        } else {
          row = std::max(row, std::abs(want));
          if (!decoder) {
            ASSERT_EQ(got, 0.0) << k;
          }
        }
      }
    }
    EXPECT_GT(row, 0) << "the pad token's row had a lookup gradient without padding_idx";
    if (decoder) {
      // the tied head's term alone: the lookup's gradient removed from the row
      double differs = 0;
      for (index_t k = 0; k < D; ++k)
        differs = std::max(
            differs, std::abs(gp.embedding_weight[pad * D + k] - g.embedding_weight[pad * D + k]));
      EXPECT_GT(differs, 0);
      EXPECT_NE(gp.embedding_weight[pad * D], 0.0);
    }
    for (index_t i = 0; i < g.layers[0].q_weight.numel(); ++i)
      ASSERT_EQ(g.layers[0].q_weight[i], gp.layers[0].q_weight[i]);
  }
  ModelConfig bad = small_config();
  bad.embeddings.padding_idx = bad.embeddings.vocab_size;
  EXPECT_THROW(bad.validate(), ConfigError);
}

// ViT's patch embedding (semantics 18.5) is Conv2d(kernel = stride = P) over each image, its
// output flattened and transposed, with [CLS] in front: checked against the convolution written
// out; and a batch of images is validated by name.
TEST(Model, PatchEmbeddingIsTheStridedConvolutionWithClsFirst) {
  ModelConfig c = small_config();
  c.embeddings.input = InputKind::patches;
  c.embeddings.image_size = 6;
  c.embeddings.patch_size = 3;
  c.embeddings.channels = 2;
  c.embeddings.max_len = 5;
  c.norms.norm_first = true;
  c.embeddings.positional = Positional::learned;
  const auto p = Params<double>::init(c, 7);
  const Batch b = Batch::random(c, 2, 5, 11);
  Activations<double> a;
  forward(p, b, a);
  const index_t D = c.d_model, P = 3, Img = 6, G = 2;
  for (index_t bi = 0; bi < 2; ++bi) {
    for (index_t d = 0; d < D; ++d) EXPECT_EQ(a.embedding[(bi * 5) * D + d], p.cls_token[d]);
    for (index_t py = 0; py < G; ++py)
      for (index_t px = 0; px < G; ++px)
        for (index_t d = 0; d < D; ++d) {
          double conv = 0;
          for (index_t ch = 0; ch < 2; ++ch)
            for (index_t i = 0; i < P; ++i)
              for (index_t j = 0; j < P; ++j)
                conv += p.patch_embedding_weight[((d * 2 + ch) * P + i) * P + j] *
                        b.pixels[static_cast<std::size_t>(((bi * 2 + ch) * Img + py * P + i) * Img +
                                                          px * P + j)];
          const double got = a.embedding[(bi * 5 + 1 + py * G + px) * D + d];
          EXPECT_NEAR(got, conv + p.patch_embedding_bias[d], 1e-14) << bi << " " << py << px;
        }
  }
  for (double x : b.pixels) {
    EXPECT_GE(x, -1.0);
    EXPECT_LT(x, 1.0);
    EXPECT_EQ(x * 256, std::floor(x * 256));  // exact in bf16 and fp16
  }
  Batch bad = b;
  bad.lengths[1] = 3;
  EXPECT_THROW(validate_batch(c, bad, 8), InputError);
  bad = b;
  bad.pixels.pop_back();
  EXPECT_THROW(validate_batch(c, bad, 8), ShapeError);
  bad = b;
  bad.pixels[4] = std::nan("");
  EXPECT_THROW(validate_batch(c, bad, 8), InputError);
  bad.pixels[4] = 1e39;  // finite in double, beyond float32
  EXPECT_NO_THROW(validate_batch(c, bad, 8));
  EXPECT_THROW(validate_batch(c, bad, 4), InputError);
  bad = b;
  bad.tokens.assign(10, 0);
  EXPECT_THROW(validate_batch(c, bad, 8), ShapeError);
  EXPECT_THROW(Batch::random(c, 2, 4, 11), ShapeError);  // S is 1 + patches
}

TEST(Model, InitialisationIsBitReproducible) {
  ModelConfig c = small_config();
  c.embeddings.positional = Positional::learned;
  std::uint64_t h = 0xCBF29CE484222325ull;
  const auto p = Params<double>::init(c, 42);
  p.visit([&](const std::string&, const Tensor<double>& t) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < sizeof(double) * t.numel(); ++i) {
      h ^= bytes[i];
      h *= 0x100000001B3ull;
    }
  });
  const auto q = Params<double>::init(c, 42);
  const auto r = Params<double>::init(c, 43);
  EXPECT_EQ(test::named(p), test::named(q));
  EXPECT_NE(test::named(p), test::named(r));
  EXPECT_EQ(h, 0x0c433ab0f3b7ae2aull) << std::hex << h;
  // Linear weights lie within PyTorch's default bound 1/sqrt(in_features).
  for (index_t i = 0; i < p.layers[0].fc2_weight.numel(); ++i)
    EXPECT_LE(std::abs(p.layers[0].fc2_weight[i]), 1 / std::sqrt(20.0));
}

TYPED_TEST(Model, EmptySequenceGivesZerosNeverNaN) {
  using Real = TypeParam;
  for (Pooling pool : {Pooling::mean, Pooling::cls, Pooling::max}) {
    for (bool pre : {false, true}) {
      ModelConfig c = small_config();
      c.head.pooling = pool;
      c.norms.norm_first = pre;
      c.attention.causal = true;
      const auto p = Params<Real>::init(c, 3);
      const Batch batch = Batch::random(c, 2, 5, 4, {0, 5});
      Activations<Real> a;
      forward(p, batch, a);
      for (const auto& l : a.layers) {
        for (index_t i = 0; i < l.probs.numel() / 2; ++i) EXPECT_EQ(l.probs[i], Real(0));
        for (index_t i = 0; i < l.context.numel() / 2; ++i) EXPECT_EQ(l.context[i], Real(0));
      }
      for (index_t c2 = 0; c2 < c.d_model; ++c2) EXPECT_EQ(a.pooled[c2], Real(0));
      Params<Real> g;
      Activations<Real> da;
      backward(p, batch, a, g, da);
      for (const auto& [name, v] : test::named(g))
        for (double x : v) ASSERT_TRUE(std::isfinite(x)) << name;
      for (const auto& [name, v] : test::named(da))
        for (double x : v) ASSERT_TRUE(std::isfinite(x)) << name;
      for (index_t i = 0; i < da.input.numel() / 2; ++i) EXPECT_EQ(da.input[i], Real(0));
    }
  }
}

TYPED_TEST(Model, EmptyBatchGivesEmptyOutputsAndZeroLoss) {
  using Real = TypeParam;
  const ModelConfig c = small_config();
  const auto p = Params<Real>::init(c, 3);
  const Batch batch = Batch::random(c, 0, 4, 4);
  Activations<Real> a;
  forward(p, batch, a);
  EXPECT_EQ(a.logits.shape(), Shape({0, 5}));
  EXPECT_EQ(a.loss[0], Real(0));
  Params<Real> g;
  Activations<Real> da;
  backward(p, batch, a, g, da);
  for (const auto& [name, v] : test::named(g))
    for (double x : v) EXPECT_EQ(x, 0.0) << name;
}

template <class E, class F>
void expect_error_naming(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one naming " << needle;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TYPED_TEST(Model, BadInputIsRejectedByNameAndChangesNothing) {
  using Real = TypeParam;
  const ModelConfig c = small_config();
  const auto p = Params<Real>::init(c, 3);
  const Batch good = Batch::random(c, 2, 4, 4);
  Activations<Real> a;
  forward(p, good, a);
  const Activations<Real> before = a;
  auto run = [&](const Batch& b) { return [&, b] { forward(p, b, a); }; };

  Batch bad = good;
  bad.tokens[5] = 13;
  expect_error_naming<InputError>(run(bad), "tokens[1][1] = 13");
  bad = good;
  bad.tokens[0] = -1;
  expect_error_naming<InputError>(run(bad), "tokens[0][0] = -1");
  bad = good;
  bad.labels[1] = 5;
  expect_error_naming<InputError>(run(bad), "labels[1] = 5");
  bad = good;
  bad.lengths[0] = 5;
  expect_error_naming<ShapeError>(run(bad), "lengths[0] = 5");
  bad = good;
  bad.lengths[1] = -1;
  expect_error_naming<ShapeError>(run(bad), "lengths[1] = -1");
  bad = good;
  bad.tokens.pop_back();
  expect_error_naming<ShapeError>(run(bad), "tokens");
  bad = Batch::random(c, 1, 9, 1);
  bad.seq_len = 10;
  bad.tokens.resize(10, 0);
  expect_error_naming<ShapeError>(run(bad), "max_len 9");
  EXPECT_TRUE(test::bitwise_equal(a, before));  // every rejected call left acts untouched

  bad = good;
  bad.batch = index_t{1} << 62;
  expect_error_naming<ShapeError>(run(bad), "overflows");
  EXPECT_TRUE(test::bitwise_equal(a, before));

  // A replayed dropout mask of the wrong size is refused before the activations are reshaped for
  // the new batch: they stay those of the last good call.
  ModelConfig cd = c;
  cd.dropout = 0.2;
  const auto pd = Params<Real>::init(cd, 3);
  Activations<Real> ad;
  forward(pd, good, ad, {.train = true, .dropout_seed = 1});
  const Activations<Real> ad_before = ad;
  const Batch other = Batch::random(cd, 3, 5, 4);
  const std::map<std::string, std::vector<std::uint8_t>> masks = {
      {"dropout.layers.0.ffn", std::vector<std::uint8_t>(7, 1)}};
  expect_error_naming<ShapeError>(
      [&] { forward(pd, other, ad, {.train = true, .dropout_seed = 1, .masks = &masks}); },
      "mask dropout.layers.0.ffn has 7 elements, expected 300 [B, S, F]");
  EXPECT_TRUE(test::bitwise_equal(ad, ad_before));
}

// Equal shapes hold equal element counts: no tensor (0 elements) is not a scalar (1).
TEST(Shape, EqualShapesHoldEqualElementCounts) {
  EXPECT_FALSE(Shape() == Shape(std::vector<index_t>{}));
  EXPECT_EQ(Shape().numel(), 0);
  EXPECT_EQ(Shape(std::vector<index_t>{}).numel(), 1);
  EXPECT_TRUE(Shape({2, 0}) == Shape({2, 0}));
  EXPECT_FALSE(Shape({2, 0}) == Shape({0, 2}));
  EXPECT_TRUE(Shape() == Shape());
}

TYPED_TEST(Model, ParamsOrActivationsThatDisagreeWithTheConfigAreRejected) {
  using Real = TypeParam;
  const ModelConfig c = small_config();
  const Batch batch = Batch::random(c, 2, 4, 4);
  Activations<Real> a;
  auto p = Params<Real>::init(c, 3);
  p.config.embeddings.positional =
      Positional::learned;  // no pos_embedding.weight was made for this
  expect_error_naming<ShapeError>([&] { forward(p, batch, a); }, "pos_embedding.weight");
  p = Params<Real>::init(c, 3);
  p.layers.pop_back();
  expect_error_naming<ShapeError>([&] { forward(p, batch, a); }, "layers");
  p = Params<Real>::init(c, 3);
  p.layers[1].fc1_weight = Tensor<Real>({3, 3});
  expect_error_naming<ShapeError>([&] { forward(p, batch, a); }, "layers.1.ffn.fc1.weight");
  Params<Real> empty;
  empty.config = c;
  expect_error_naming<ShapeError>([&] { forward(empty, batch, a); }, "layers");

  // backward with activations from a different config or batch
  p = Params<Real>::init(c, 3);
  forward(p, batch, a);
  Params<Real> g;
  Activations<Real> da;
  auto pmax = p;
  pmax.config.head.pooling = Pooling::max;
  expect_error_naming<ShapeError>([&] { backward(pmax, batch, a, g, da); }, "pool_argmax");
  auto ppre = Params<Real>::init(
      [&] {
        auto x = c;
        x.norms.norm_first = true;
        return x;
      }(),
      3);
  expect_error_naming<ShapeError>([&] { backward(ppre, batch, a, g, da); }, "norm_first");
  const Batch longer = Batch::random(c, 2, 5, 4);
  expect_error_naming<ShapeError>([&] { backward(p, longer, a, g, da); }, "activation");
  expect_error_naming<ShapeError>([&] { encoder_forward(p, longer, a); }, "activation");
}

// A forward pass over a batch with an empty sequence stores argmax -1 for it; a backward pass with
// those activations and a batch of the same B and S whose sequences are all full would add into
// position -1. It is rejected by name, and writes no gradient (under ASan, no write out of bounds).
TYPED_TEST(Model, BackwardRejectsPoolArgmaxFromAnotherBatch) {
  using Real = TypeParam;
  ModelConfig c = small_config();
  c.head.pooling = Pooling::max;
  const auto p = Params<Real>::init(c, 3);
  const Batch with_empty = Batch::random(c, 2, 4, 4, {4, 0});
  const Batch full = Batch::random(c, 2, 4, 4, {4, 4});
  Activations<Real> a;
  forward(p, with_empty, a);
  ASSERT_EQ(a.pool_argmax[static_cast<std::size_t>(c.d_model)], -1);
  Params<Real> g = Params<Real>::zeros(c);
  Activations<Real> da;
  g.head_bias[0] = Real(7);
  expect_error_naming<ShapeError>([&] { backward(p, full, a, g, da); }, "pool_argmax[1, 0]");
  EXPECT_EQ(g.head_bias[0], Real(7)) << "a rejected backward changed a gradient";
  // An argmax past the sequence's length is rejected the same way.
  forward(p, full, a);
  a.pool_argmax[0] = 4;
  expect_error_naming<ShapeError>([&] { backward(p, full, a, g, da); }, "pool_argmax[0, 0]");
  a.pool_argmax[0] = 3;
  EXPECT_NO_THROW(backward(p, full, a, g, da));
}

TYPED_TEST(Model, ForwardIsDeterministicAndDropoutFollowsTheSeed) {
  using Real = TypeParam;
  ModelConfig c = small_config();
  c.dropout = 0.3;
  const auto p = Params<Real>::init(c, 3);
  const Batch batch = Batch::random(c, 3, 6, 4, {6, 2, 5});
  Activations<Real> a1, a2, a3, eval1, eval0;
  forward(p, batch, a1, {.train = true, .dropout_seed = 7});
  forward(p, batch, a2, {.train = true, .dropout_seed = 7});
  forward(p, batch, a3, {.train = true, .dropout_seed = 8});
  EXPECT_TRUE(test::bitwise_equal(a1, a2));
  EXPECT_FALSE(test::bitwise_equal(a1, a3));
  EXPECT_EQ(a1.input_mask.size(), static_cast<std::size_t>(3 * 6 * 12));
  EXPECT_EQ(a1.layers[0].masks.attn.size(), static_cast<std::size_t>(3 * 3 * 6 * 6));
  // eval mode is the identity at every site and equals dropout = 0
  forward(p, batch, eval1, {.train = false});
  ModelConfig c0 = c;
  c0.dropout = 0;
  Params<Real> p0 = p;
  p0.config = c0;
  forward(p0, batch, eval0);
  EXPECT_TRUE(eval1.input_mask.empty());
  EXPECT_TRUE(test::bitwise_equal(eval1, eval0));
}

// The float forward and backward agree with the double ones run on the same (float-valued)
// parameters. Tolerance: 1e-4 of each tensor's largest magnitude. Float's unit roundoff is 6e-8;
// two layers of LayerNorm, softmax and GEMMs of length <= 20 amplify it by well under 1e3 here.
TEST(Model, FloatAgreesWithDouble) {
  for (bool pre : {false, true}) {
    for (Activation act :
         {Activation::relu, Activation::gelu, Activation::gelu_tanh, Activation::silu}) {
      ModelConfig c = small_config();
      c.norms.norm_first = pre;
      c.ffn.activation = act;
      c.attention.causal = pre;
      c.head.label_smoothing = 0.1;
      c.dropout = 0.1;
      const auto pf = Params<float>::init(c, 5);
      const auto pd = test::convert_params<double>(pf);
      const Batch batch = Batch::random(c, 3, 8, 6, {8, 1, 5});
      Activations<float> af, gaf;
      Activations<double> ad, gad;
      Params<float> gf;
      Params<double> gd;
      forward(pf, batch, af, {.dropout_seed = 3});
      forward(pd, batch, ad, {.dropout_seed = 3});
      backward(pf, batch, af, gf, gaf);
      backward(pd, batch, ad, gd, gad);
      const auto nf = test::named(af), nd = test::named(ad);
      for (const auto& [name, v] : nd) EXPECT_LE(test::compare(nf.at(name), v), 1e-4) << name;
      const auto gnf = test::named(gaf), gnd = test::named(gad);
      for (const auto& [name, v] : gnd)
        EXPECT_LE(test::compare(gnf.at(name), v), 1e-4) << "grad.act." << name;
      // Some parameter gradients are exactly 0 in exact arithmetic (attn.k.bias: softmax ignores a
      // shift shared by a row), so each is judged against at least 1% of the largest gradient.
      const auto pnf = test::named(gf), pnd = test::named(gd);
      double largest = 0;
      for (const auto& [name, v] : pnd)
        for (double x : v) largest = std::max(largest, std::abs(x));
      for (const auto& [name, v] : pnd)
        EXPECT_LE(test::compare(pnf.at(name), v, 1e-2 * largest), 1e-4) << "grad." << name;
    }
  }
}

}  // namespace
}  // namespace teo
