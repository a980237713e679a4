// rapidcheck properties over random valid configs and batches. Generators reach the edges:
// batch 0, length 0 and 1, seq_len 1, one head, d_head 1, zero layers, one class.
#include <cmath>
#include <memory>
#include <numeric>

#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>
#include <nlohmann/json.hpp>

#include "rc_support.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/positional.hpp"

namespace teo {
namespace {

ModelConfig gen_config() {
  ModelConfig c;
  c.attention.num_heads = *rc::gen::inRange<index_t>(1, 4);
  c.d_model = c.attention.num_heads * *rc::gen::inRange<index_t>(1, 5);
  c.ffn.d_ff = *rc::gen::inRange<index_t>(1, 17);
  c.num_layers = *rc::gen::inRange<index_t>(0, 4);
  c.embeddings.vocab_size = *rc::gen::inRange<index_t>(1, 21);
  c.embeddings.max_len = *rc::gen::inRange<index_t>(1, 13);
  c.head.num_classes = *rc::gen::inRange<index_t>(1, 6);
  c.norms.norm_first = *rc::gen::arbitrary<bool>();
  c.ffn.activation = *rc::gen::element(Activation::relu, Activation::gelu, Activation::gelu_tanh);
  c.embeddings.positional = *rc::gen::element(Positional::sinusoidal, Positional::learned);
  c.embeddings.embed_scale = *rc::gen::arbitrary<bool>();
  c.head.pooling = *rc::gen::element(Pooling::mean, Pooling::cls, Pooling::max);
  c.attention.causal = *rc::gen::arbitrary<bool>();
  c.head.label_smoothing = *rc::gen::element(0.0, 0.1, 1.0);
  c.dropout = *rc::gen::element(0.0, 0.0, 0.25);
  return c;
}

using test::gen_backend;

Batch gen_batch(const ModelConfig& c, index_t min_batch = 0) {
  const index_t b = *rc::gen::inRange<index_t>(min_batch, 5);
  const index_t s = *rc::gen::inRange<index_t>(1, c.embeddings.max_len + 1);
  std::vector<std::int64_t> len(static_cast<std::size_t>(b));
  for (auto& l : len)
    l = *rc::gen::oneOf(rc::gen::just<index_t>(0), rc::gen::just(s),
                        rc::gen::inRange<index_t>(0, s + 1));
  return Batch::random(c, b, s, *rc::gen::arbitrary<std::uint32_t>(), len);
}

// The shape each named activation must have.
Shape expected_shape(const std::string& name, const ModelConfig& c, const Batch& b) {
  auto ends = [&](const char* s) {
    const std::string suf = s;
    return name.size() >= suf.size() &&
           name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  const index_t B = b.batch, S = b.seq_len, D = c.d_model, H = c.attention.num_heads;
  if (name == "positional") return Shape({S, D});
  if (name == "pooled") return Shape({B, D});
  if (name == "logits") return Shape({B, c.head.num_classes});
  if (name == "loss") return Shape(std::vector<index_t>{});
  if (ends(".q") || ends(".k") || ends(".v")) return Shape({B, H, S, c.d_head()});
  if (ends(".scores") || ends(".probs")) return Shape({B, H, S, S});
  if (ends(".ffn_pre") || ends(".ffn_hidden")) return Shape({B, S, c.ffn.d_ff});
  return Shape({B, S, D});
}

RC_GTEST_PROP(Properties, EveryStageHasTheRightShape, ()) {
  const ModelConfig c = gen_config();
  const Batch b = gen_batch(c);
  const auto p = Params<double>::init(c, 1);
  Activations<double> a, da;
  Params<double> g;
  forward(p, b, a, {.dropout_seed = 5});
  backward(p, b, a, g, da);
  std::size_t n = 0;
  a.visit([&](const std::string& name, const Tensor<double>& t) {
    RC_ASSERT(t.shape() == expected_shape(name, c, b));
    ++n;
  });
  // embedding, positional, input; 15 per layer; final_norm (pre-norm); pooled, logits, loss
  RC_ASSERT(n ==
            3 + 15 * static_cast<std::size_t>(c.num_layers) + (c.norms.norm_first ? 1 : 0) + 3);
  da.visit([&](const std::string& name, const Tensor<double>& t) {
    RC_ASSERT(t.shape() == expected_shape(name, c, b));
  });
  std::vector<Shape> ps;
  p.visit([&](const std::string&, const Tensor<double>& t) { ps.push_back(t.shape()); });
  std::size_t k = 0;
  g.visit([&](const std::string&, const Tensor<double>& t) { RC_ASSERT(t.shape() == ps[k++]); });
  RC_ASSERT(k == ps.size());
  RC_ASSERT(std::isfinite(a.loss[0]));
}

RC_GTEST_PROP(Properties, SoftmaxRowsSumToOneAndMaskedEntriesAreExactlyZero, ()) {
  const ModelConfig c = gen_config();
  const Batch b = gen_batch(c);
  const auto p = Params<double>::init(c, 2);
  Activations<double> a;
  forward(p, b, a);
  const index_t S = b.seq_len;
  for (const auto& l : a.layers)
    for (index_t bb = 0; bb < b.batch; ++bb)
      for (index_t h = 0; h < c.attention.num_heads; ++h)
        for (index_t i = 0; i < S; ++i) {
          const index_t visible =
              c.attention.causal ? std::min<index_t>(b.lengths[bb], i + 1) : b.lengths[bb];
          double sum = 0;
          for (index_t j = 0; j < S; ++j) {
            const double pr = l.probs[((bb * c.attention.num_heads + h) * S + i) * S + j];
            RC_ASSERT(pr >= 0.0);
            // A padded key (j >= len) or, with the causal mask, a later one (j > i) gets exactly 0.
            if (j >= b.lengths[bb] || (c.attention.causal && j > i)) RC_ASSERT(pr == 0.0);
            sum += pr;
          }
          if (visible == 0) {
            RC_ASSERT(sum == 0.0);
          } else {
            RC_ASSERT(std::abs(sum - 1.0) <= 1e-14 * static_cast<double>(S + 1));
          }
        }
}

RC_GTEST_PROP(Properties, LayerNormWithUnitWeightGivesMeanZeroVarianceOne, ()) {
  const index_t rows = *rc::gen::inRange<index_t>(1, 6);
  const index_t cols = *rc::gen::inRange<index_t>(2, 65);
  const double spread = *rc::gen::element(1.0, 10.0, 1000.0);
  const double offset = *rc::gen::element(0.0, 5.0, -300.0);
  auto x = test::uniform_vector<double>(rows * cols, *rc::gen::arbitrary<std::uint32_t>(), "x",
                                        offset - spread, offset + spread);
  std::vector<double> w(cols, 1.0), bias(cols, 0.0), y(x.size()), m(rows), s(rows);
  const double eps = 1e-5;
  layer_norm_forward(y.data(), m.data(), s.data(), x.data(), w.data(), bias.data(), rows, cols,
                     eps);
  for (index_t r = 0; r < rows; ++r) {
    double in_mean = 0, in_var = 0, mean = 0, var = 0;
    for (index_t c = 0; c < cols; ++c) in_mean += x[r * cols + c] / cols;
    for (index_t c = 0; c < cols; ++c)
      in_var += (x[r * cols + c] - in_mean) * (x[r * cols + c] - in_mean) / cols;
    if (in_var < 1e-6) continue;  // a (near-)constant row: eps dominates, variance is not 1
    for (index_t c = 0; c < cols; ++c) mean += y[r * cols + c] / cols;
    for (index_t c = 0; c < cols; ++c)
      var += (y[r * cols + c] - mean) * (y[r * cols + c] - mean) / cols;
    // Rounding in x - mean is ~u * max|x| per element, amplified by rstd ~ 1 / sqrt(in_var):
    // the bound allows 64 such units, so a row far from 0 with a small spread is judged fairly.
    double max_abs = 0;
    for (index_t c = 0; c < cols; ++c) max_abs = std::max(max_abs, std::abs(x[r * cols + c]));
    const double tol = 64 * 0x1p-53 * (max_abs / std::sqrt(in_var) + 1);
    RC_ASSERT(std::abs(mean) <= tol);
    // exactly in_var / (in_var + eps) in real arithmetic: 1 up to the eps term
    RC_ASSERT(std::abs(var - in_var / (in_var + eps)) <= 2 * tol);
    RC_ASSERT(std::abs(var - 1.0) <= eps / in_var + 2 * tol);
  }
}

// Positional-encoding identities, in double, for even and odd widths.
RC_GTEST_PROP(Properties, SinusoidalIdentities, ()) {
  const index_t d = *rc::gen::inRange<index_t>(1, 65);
  const index_t len = *rc::gen::inRange<index_t>(1, 300);
  std::vector<double> pe(len * d);
  sinusoidal_table(pe.data(), len, d);
  auto at = [&](index_t p, index_t c) { return pe[p * d + c]; };
  // PE(0) = [0, 1, 0, 1, ...], exactly; |PE| <= 1 everywhere.
  for (index_t c = 0; c < d; ++c) RC_ASSERT(at(0, c) == (c % 2 == 0 ? 0.0 : 1.0));
  for (double v : pe) RC_ASSERT(std::abs(v) <= 1.0);
  // PE(p, 2i)^2 + PE(p, 2i+1)^2 = 1.
  for (index_t p = 0; p < len; ++p)
    for (index_t i = 0; 2 * i + 1 < d; ++i)
      RC_ASSERT(std::abs(at(p, 2 * i) * at(p, 2 * i) + at(p, 2 * i + 1) * at(p, 2 * i + 1) - 1) <=
                4e-16);
  // PE(p + k) = R(k) PE(p): per pair, the rotation by angle k * w_i, whose entries are read off
  // PE(k) itself, so R depends on k only.
  const index_t p = *rc::gen::inRange<index_t>(0, len);
  const index_t k = *rc::gen::inRange<index_t>(0, len - p);
  for (index_t i = 0; 2 * i + 1 < d; ++i) {
    const double sk = at(k, 2 * i), ck = at(k, 2 * i + 1);  // sin(k w), cos(k w)
    const double sp = at(p, 2 * i), cp = at(p, 2 * i + 1);
    // Angle arguments up to ~300 carry ~300 ulp of absolute error through sin and cos.
    RC_ASSERT(std::abs(at(p + k, 2 * i) - (ck * sp + sk * cp)) <= 1e-12);
    RC_ASSERT(std::abs(at(p + k, 2 * i + 1) - (ck * cp - sk * sp)) <= 1e-12);
  }
  // PE(p) . PE(q) depends on |p - q| only.
  auto dot = [&](index_t a, index_t b) {
    double s = 0;
    for (index_t i = 0; 2 * i + 1 < d; ++i)
      s += at(a, 2 * i) * at(b, 2 * i) + at(a, 2 * i + 1) * at(b, 2 * i + 1);
    return s;  // the pairs only: an odd width's last sin column is not a rotation
  };
  const index_t q = *rc::gen::inRange<index_t>(0, len);
  const index_t shift = *rc::gen::inRange<index_t>(0, len - std::max(p, q));
  RC_ASSERT(std::abs(dot(p, q) - dot(p + shift, q + shift)) <= 1e-11 * static_cast<double>(d));
  RC_ASSERT(std::abs(dot(p, q) - dot(q, p)) <= 1e-14 * static_cast<double>(d));
}

RC_GTEST_PROP(Properties, WithoutPositionsPermutingTokensPermutesOutputs, ()) {
  ModelConfig c = gen_config();
  c.embeddings.positional =
      Positional::learned;  // with pos_embedding.weight zeroed: no position signal
  c.attention.causal = false;
  c.dropout = 0;
  c.head.pooling = *rc::gen::element(Pooling::mean, Pooling::max);
  auto p = Params<double>::init(c, 3);
  p.pos_embedding_weight.zero();
  Batch b = gen_batch(c, 1);
  for (auto& l : b.lengths) l = b.seq_len;
  const index_t S = b.seq_len, D = c.d_model;
  std::vector<index_t> perm(S);
  std::iota(perm.begin(), perm.end(), 0);
  perm = *rc::gen::just(perm);
  const auto keys =
      *rc::gen::container<std::vector<std::uint32_t>>(S, rc::gen::arbitrary<std::uint32_t>());
  std::stable_sort(perm.begin(), perm.end(),
                   [&](index_t x, index_t y) { return keys[x] < keys[y]; });
  Batch pb = b;
  for (index_t bb = 0; bb < b.batch; ++bb)
    for (index_t s = 0; s < S; ++s) pb.tokens[bb * S + s] = b.tokens[bb * S + perm[s]];
  Activations<double> a, pa;
  forward(p, b, a);
  forward(p, pb, pa);
  const Tensor<double>& out = c.num_layers ? a.layers.back().output : a.input;
  const Tensor<double>& pout = c.num_layers ? pa.layers.back().output : pa.input;
  for (index_t bb = 0; bb < b.batch; ++bb)
    for (index_t s = 0; s < S; ++s)
      for (index_t k = 0; k < D; ++k)
        RC_ASSERT(std::abs(pout[(bb * S + s) * D + k] - out[(bb * S + perm[s]) * D + k]) <= 1e-12);
  RC_ASSERT(std::abs(a.loss[0] - pa.loss[0]) <= 1e-12);  // mean and max pooling are symmetric
}

RC_GTEST_PROP(Properties, PaddedTokensChangeNoRealOutputNorTheLoss, ()) {
  const auto backend = gen_backend();
  const ModelConfig c = gen_config();
  const Batch b = gen_batch(c, 1);
  Batch changed = b;
  const auto salt = *rc::gen::arbitrary<std::uint32_t>();
  for (index_t bb = 0; bb < b.batch; ++bb)
    for (index_t s = b.lengths[bb]; s < b.seq_len; ++s)
      changed.tokens[bb * b.seq_len + s] = static_cast<std::int64_t>(
          rng::bits(salt, 9, bb * b.seq_len + s) % c.embeddings.vocab_size);
  const auto p = Params<double>::init(c, 4);
  Activations<double> a, ca;
  forward(p, b, a, {.dropout_seed = 6});
  forward(p, changed, ca, {.dropout_seed = 6});
  const index_t S = b.seq_len, D = c.d_model;
  for (std::size_t l = 0; l < a.layers.size(); ++l)
    for (index_t bb = 0; bb < b.batch; ++bb)
      for (index_t s = 0; s < b.lengths[bb]; ++s)
        for (index_t k = 0; k < D; ++k)
          RC_ASSERT(a.layers[l].output[(bb * S + s) * D + k] ==
                    ca.layers[l].output[(bb * S + s) * D + k]);
  for (index_t i = 0; i < a.logits.numel(); ++i) RC_ASSERT(a.logits[i] == ca.logits[i]);
  RC_ASSERT(a.loss[0] == ca.loss[0]);
}

RC_GTEST_PROP(Properties, SequenceOutputsDoNotDependOnTheRestOfTheBatch, ()) {
  const auto backend = gen_backend();
  ModelConfig c = gen_config();
  c.dropout = 0;  // masks are indexed by position in the batch (docs/semantics.md)
  const Batch b = gen_batch(c, 1);
  const auto p = Params<double>::init(c, 5);
  Activations<double> a;
  forward(p, b, a);
  const index_t bb = *rc::gen::inRange<index_t>(0, b.batch);
  const index_t S = b.seq_len, D = c.d_model;
  Batch one;
  one.batch = 1;
  one.seq_len = S;
  one.tokens.assign(b.tokens.begin() + bb * S, b.tokens.begin() + (bb + 1) * S);
  one.lengths = {b.lengths[bb]};
  one.labels = {b.labels[bb]};
  Activations<double> o;
  forward(p, one, o);
  // Bit for bit on the reference and simd backends; OpenBLAS picks its kernels (and so its
  // summation order) by the product's shape, so there a sequence agrees to rounding only.
  const bool bitwise = teo::backend() != Backend::blas;
  auto same = [&](const double* x, const double* y, index_t n) {
    if (bitwise) return std::memcmp(x, y, sizeof(double) * static_cast<std::size_t>(n)) == 0;
    for (index_t i = 0; i < n; ++i)
      if (std::abs(x[i] - y[i]) > 1e-12 * (1 + std::abs(x[i]))) return false;
    return true;
  };
  for (std::size_t l = 0; l < a.layers.size(); ++l)
    RC_ASSERT(same(&a.layers[l].output[bb * S * D], o.layers[l].output.data(), S * D));
  RC_ASSERT(same(&a.logits[bb * c.head.num_classes], o.logits.data(), c.head.num_classes));
}

// With dropout on, a sequence keeps its outputs, bit for bit, whatever the other sequences of a
// batch of the same shape hold: masks are indexed by position, never by content.
RC_GTEST_PROP(Properties, WithDropoutASequenceIgnoresItsNeighbours, ()) {
  const auto backend = gen_backend();
  ModelConfig c = gen_config();
  c.dropout = 0.25;
  const Batch b = gen_batch(c, 2);
  const auto p = Params<double>::init(c, 5);
  const index_t keep = *rc::gen::inRange<index_t>(0, b.batch);
  Batch other = Batch::random(c, b.batch, b.seq_len, *rc::gen::arbitrary<std::uint32_t>());
  const index_t S = b.seq_len, D = c.d_model;
  std::copy(b.tokens.begin() + keep * S, b.tokens.begin() + (keep + 1) * S,
            other.tokens.begin() + keep * S);
  other.lengths[keep] = b.lengths[keep];
  other.labels[keep] = b.labels[keep];
  Activations<double> a, o;
  forward(p, b, a, {.dropout_seed = 11});
  forward(p, other, o, {.dropout_seed = 11});
  for (std::size_t l = 0; l < a.layers.size(); ++l)
    RC_ASSERT(std::memcmp(&a.layers[l].output[keep * S * D], &o.layers[l].output[keep * S * D],
                          sizeof(double) * S * D) == 0);
  RC_ASSERT(std::memcmp(&a.logits[keep * c.head.num_classes], &o.logits[keep * c.head.num_classes],
                        sizeof(double) * c.head.num_classes) == 0);
}

// Random JSON objects over the real keys with values of every type and sign: the parser either
// accepts a config that then validates and runs, or throws a named teo error.
RC_GTEST_PROP(Properties, InvalidConfigsAreRejectedWithNamedErrors, ()) {
  static const std::vector<std::string> keys = {"vocab_size",   "max_len",      "d_model",
                                                "num_heads",    "d_ff",         "num_layers",
                                                "norm_first",   "activation",   "layer_norm_eps",
                                                "positional",   "embed_scale",  "pooling",
                                                "num_classes",  "dropout",      "label_smoothing",
                                                "causal",       "bogus",        "norm",
                                                "ffn",          "ffn_bias",     "attn_bias",
                                                "head_bias",    "architecture", "tie_embeddings",
                                                "attn_out_bias"};
  nlohmann::json j = nlohmann::json::object();
  const int n = *rc::gen::inRange(0, 6);
  for (int i = 0; i < n; ++i) {
    const std::string& key = *rc::gen::elementOf(keys);
    switch (*rc::gen::inRange(0, 6)) {
      case 0:
        j[key] = *rc::gen::inRange<std::int64_t>(-3, 9);
        break;
      case 1:
        j[key] = *rc::gen::element<std::int64_t>(INT64_MAX, INT64_MIN, std::int64_t{1} << 40);
        break;
      case 2:
        j[key] = *rc::gen::element(-0.5, 0.0, 0.3, 1.0, 2.5, 1e300);
        break;
      case 3:
        j[key] = *rc::gen::arbitrary<bool>();
        break;
      case 4:
        j[key] = *rc::gen::element<std::string>("relu", "gelu", "learned", "max", "x", "", "silu",
                                                "rmsnorm", "swiglu", "geglu", "decoder");
        break;
      default:
        j[key] = nullptr;
        break;
    }
  }
  try {
    const ModelConfig c = ModelConfig::from_json(j);
    c.validate();
    if (c.embeddings.vocab_size <= 64 && c.d_model <= 16 && c.ffn.d_ff <= 16 && c.num_layers <= 8 &&
        c.embeddings.max_len <= 64 && c.head.num_classes <= 16) {
      const auto p = Params<double>::init(c, 0);
      Activations<double> a;
      forward(p, Batch::random(c, 2, 1, 0), a);
      RC_ASSERT(std::isfinite(a.loss[0]));
    }
  } catch (const ConfigError& e) {
    // The message names one of the keys this config set (the offender, or for the divisibility
    // rule d_model / num_heads, both of which it names).
    const std::string msg = e.what();
    bool named = msg.find("JSON object") != std::string::npos;
    for (const auto& [key, v] : j.items()) named = named || msg.find(key) != std::string::npos;
    RC_ASSERT(named);
  } catch (const ShapeError& e) {
    const std::string msg = e.what();
    RC_ASSERT(msg.find("overflow") != std::string::npos ||
              msg.find("address space") != std::string::npos ||
              msg.find("TEO_MAX_BYTES") != std::string::npos ||
              msg.find("TEO_MAX_TENSOR_ELEMENTS") != std::string::npos);
  }
}

// Random corruptions of a valid batch: each is rejected with ShapeError or InputError naming the
// field, and the activations of an earlier call stay as they were.
RC_GTEST_PROP(Properties, InvalidBatchesAreRejectedWithNamedErrors, ()) {
  const ModelConfig c = gen_config();
  const Batch good = gen_batch(c, 1);
  const auto p = Params<double>::init(c, 7);
  Activations<double> a;
  forward(p, good, a);
  const Activations<double> before = a;
  Batch bad = good;
  std::string needle;
  bool shape = true;
  switch (*rc::gen::inRange(0, 7)) {
    case 0: {
      const auto i = *rc::gen::inRange<std::size_t>(0, bad.tokens.size());
      bad.tokens[i] =
          *rc::gen::element<std::int64_t>(-1, c.embeddings.vocab_size, INT64_MAX, INT64_MIN);
      needle = "tokens[";
      shape = false;
      break;
    }
    case 1: {
      const auto i = *rc::gen::inRange<std::size_t>(0, bad.labels.size());
      bad.labels[i] = *rc::gen::element<std::int64_t>(-1, c.head.num_classes, INT64_MAX);
      needle = "labels[";
      shape = false;
      break;
    }
    case 2: {
      const auto i = *rc::gen::inRange<std::size_t>(0, bad.lengths.size());
      bad.lengths[i] = *rc::gen::element<std::int64_t>(-1, bad.seq_len + 1, INT64_MAX);
      needle = "lengths[";
      break;
    }
    case 3:
      bad.tokens.push_back(0);
      needle = "tokens";
      break;
    case 4:
      bad.lengths.pop_back();
      needle = "lengths";
      break;
    case 5:
      bad.seq_len = c.embeddings.max_len + *rc::gen::inRange<index_t>(1, 4);
      bad.tokens.assign(bad.batch * bad.seq_len, 0);
      needle = "max_len";
      break;
    default:
      bad.batch = *rc::gen::element<index_t>(-1, index_t{1} << 62);
      needle = "batch";
      break;
  }
  try {
    forward(p, bad, a);
    RC_FAIL("accepted an invalid batch");
  } catch (const ShapeError& e) {
    RC_ASSERT(shape);
    RC_ASSERT(std::string(e.what()).find(needle) != std::string::npos);
  } catch (const InputError& e) {
    RC_ASSERT(!shape);
    RC_ASSERT(std::string(e.what()).find(needle) != std::string::npos);
  }
  RC_ASSERT(test::bitwise_equal(a, before));
}

}  // namespace
}  // namespace teo
