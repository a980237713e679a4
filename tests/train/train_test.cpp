// Training pieces: the word-list dataset, the vocabulary, the naive Bayes yardstick, the schedule,
// clipping and AdamW against their formulas, and bit-exact resume of `teo train`.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "train/word_lists.hpp"

#include "teo/backend.hpp"
#include "teo/files.hpp"
#include "teo/safetensors.hpp"
#include "teo/train.hpp"

namespace {

namespace fs = std::filesystem;
namespace tr = teo::train;
using teo::train::TrainOptions;

double test_named_max_diff(const teo::Params<double>& a, const teo::Params<double>& b) {
  std::vector<const teo::Tensor<double>*> tb;
  b.visit([&](const std::string&, const teo::Tensor<double>& t) { tb.push_back(&t); });
  double worst = 0;
  std::size_t k = 0;
  a.visit([&](const std::string&, const teo::Tensor<double>& t) {
    for (teo::index_t i = 0; i < t.numel(); ++i)
      worst = std::max(worst, std::abs(t[i] - (*tb[k])[i]));
    ++k;
  });
  return worst;
}

TEST(TrainData, Utf8RoundTripsAndRejectsMalformedBytes) {
  const std::string s = "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";
  bool ok = false;
  const auto cps = tr::utf8_decode(s, &ok);
  ASSERT_TRUE(ok);
  EXPECT_EQ(cps,
            (std::u32string{U'c', U'a', U'f', U'\u00e9', U' ', U'\u20ac', U' ', U'\U0001F600'}));
  EXPECT_EQ(tr::utf8_encode(cps), s);
  for (const std::string bad :
       {"\xc3", "\xe2\x82", "\x80", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "a\xffz"}) {
    tr::utf8_decode(bad, &ok);
    EXPECT_FALSE(ok) << "accepted a malformed sequence of " << bad.size() << " bytes";
  }
}

TEST(TrainData, DropsSharedWordsCapsAndSplitsStablyByHash) {
  const fs::path dir = teo::test::fake_lists("teo_train_lists");
  tr::DataOptions opts;
  opts.dir = dir.string();
  opts.per_language = 50;
  const tr::Dataset a = tr::load_words(opts);
  const tr::Dataset b = tr::load_words(opts);
  std::set<std::u32string> words;
  std::vector<int> per_label(tr::languages().size(), 0);
  for (const auto* split : {&a.train, &a.valid, &a.test}) {
    for (const auto& e : *split) {
      EXPECT_TRUE(words.insert(e.word).second) << "a word appears in two splits";
      EXPECT_NE(e.word, U"shared");
      EXPECT_NE(e.word, U"casa");
      ++per_label[static_cast<std::size_t>(e.label)];
    }
  }
  for (int n : per_label) EXPECT_EQ(n, 50) << "the cap balances the classes";
  EXPECT_EQ(a.dropped_shared[0], 1);
  EXPECT_EQ(a.dropped_shared[3], 2);
  EXPECT_GT(a.train.size(), 3 * (a.valid.size() + a.test.size()) / 2);
  EXPECT_GT(a.valid.size(), 0u);
  EXPECT_GT(a.test.size(), 0u);
  ASSERT_EQ(a.test.size(), b.test.size());
  for (std::size_t i = 0; i < a.test.size(); ++i) EXPECT_EQ(a.test[i].word, b.test[i].word);
  // A word's split depends on the word alone: with a larger cap, every test word stays in test.
  opts.per_language = 60;
  const tr::Dataset c = tr::load_words(opts);
  std::set<std::u32string> c_test;
  for (const auto& e : c.test) c_test.insert(e.word);
  for (const auto& e : a.test) EXPECT_TRUE(c_test.count(e.word));
}

TEST(TrainData, AMissingListNamesThePackageToInstall) {
  const fs::path dir = teo::test::fake_lists("teo_train_missing");
  fs::remove(dir / "italian");
  tr::DataOptions opts;
  opts.dir = dir.string();
  try {
    tr::load_words(opts);
    FAIL() << "no error";
  } catch (const teo::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install witalian"), std::string::npos)
        << e.what();
  }
  std::ofstream(dir / "italian") << "ok\n\xff\xfe\n";
  EXPECT_THROW(tr::load_words(opts), teo::InputError) << "a list that is not UTF-8";
}

TEST(TrainData, VocabularyEncodesWithClsPadAndUnk) {
  std::vector<tr::Example> train = {{U"ab", 0}, {U"b\u00e9", 1}};
  const tr::Vocab v = tr::Vocab::build(train);
  EXPECT_EQ(v.size(), 4 + 3);
  EXPECT_EQ(v.encode(U"ba\u00e9z", 32), (std::vector<std::int64_t>{1, 5, 4, 6, 2, 3}));
  EXPECT_EQ(v.encode(U"abab", 4), (std::vector<std::int64_t>{1, 4, 5, 3})) << "cut to max_len";
  const tr::Vocab w = tr::Vocab::from_json(v.to_json());
  EXPECT_EQ(w.encode(U"ba\u00e9z", 32), v.encode(U"ba\u00e9z", 32));
  const tr::Example e1{U"a", 2}, e2{U"abb", 4};
  const teo::Batch b = tr::make_batch(v, {&e1, &e2}, 32);
  EXPECT_EQ(b.seq_len, 5) << "padded to the longest word plus [CLS] and [SEP]";
  EXPECT_EQ(b.tokens, (std::vector<std::int64_t>{1, 4, 3, 0, 0, 1, 4, 5, 5, 3}));
  EXPECT_EQ(b.lengths, (std::vector<std::int64_t>{3, 5}));
  EXPECT_EQ(b.labels, (std::vector<std::int64_t>{2, 4}));
}

TEST(TrainBaseline, NaiveBayesLearnsTelltaleTrigrams) {
  tr::DataOptions opts;
  opts.dir = teo::test::fake_lists("teo_train_nb").string();
  const tr::Dataset d = tr::load_words(opts);
  tr::NaiveBayes nb;
  nb.fit(d.train, 5);
  int correct = 0;
  for (const auto& e : d.test) correct += nb.predict(e.word) == e.label;
  EXPECT_EQ(correct, static_cast<int>(d.test.size()));
}

TEST(TrainOptim, ScheduleWarmsUpLinearlyThenDecaysAsInverseSqrt) {
  tr::OptimOptions o;
  o.lr = 1e-3;
  o.warmup_steps = 100;
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 1), 1e-5);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 50), 5e-4);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 100), 1e-3);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 400), 5e-4);
  EXPECT_DOUBLE_EQ(tr::learning_rate(o, 10000), 1e-4);
}

TEST(TrainOptim, ClippingMatchesTorchSemantics) {
  teo::EncoderConfig cfg;
  cfg.num_layers = 1;
  auto g = teo::Params<double>::init(cfg, 3);
  const double norm = tr::global_norm(g);
  ASSERT_GT(norm, 1.0);
  auto clipped = g;
  tr::clip_by_norm(clipped, norm, 1.0);
  EXPECT_NEAR(tr::global_norm(clipped), 1.0 * norm / (norm + 1e-6), 1e-12);
  auto same = g;
  tr::clip_by_norm(same, norm, 2 * norm);
  EXPECT_EQ(same.embedding_weight[5], g.embedding_weight[5]) << "coef clamps to 1";
  tr::clip_by_norm(same, norm, 0);
  EXPECT_EQ(same.head_bias[0], g.head_bias[0]) << "max_norm 0 is off";
}

TEST(TrainOptim, AdamWFollowsTorchsUpdateRule) {
  teo::EncoderConfig cfg;
  cfg.num_layers = 1;
  auto p = teo::Params<double>::init(cfg, 1);
  const auto p0 = p;
  auto g = teo::Params<double>::init(cfg, 2);
  tr::OptimOptions o;
  o.weight_decay = 0.1;
  auto adam = tr::AdamW<double>::zeros(cfg);
  const double lr = 0.01;
  adam.update(p, g, o, lr);
  adam.update(p, g, o, lr);
  // Two steps with the same gradient, by hand: m_t = (1 - b1^t) g, v_t = (1 - b2^t) g^2, so
  // m_hat = g and v_hat = g^2 at both steps.
  auto expect = [&](double x0, double gi, bool decay) {
    double x = x0;
    for (int t = 1; t <= 2; ++t) {
      if (decay) x *= 1 - lr * o.weight_decay;
      const double m = (1 - std::pow(o.beta1, t)) * gi, v = (1 - std::pow(o.beta2, t)) * gi * gi;
      x -= lr / (1 - std::pow(o.beta1, t)) * m /
           (std::sqrt(v) / std::sqrt(1 - std::pow(o.beta2, t)) + o.adam_eps);
    }
    return x;
  };
  const auto& w = p.layers[0].q_weight;
  EXPECT_NEAR(w[7], expect(p0.layers[0].q_weight[7], g.layers[0].q_weight[7], true), 1e-15);
  EXPECT_NEAR(p.layers[0].q_bias[3], expect(p0.layers[0].q_bias[3], g.layers[0].q_bias[3], false),
              1e-15);
  EXPECT_NEAR(p.layers[0].norm1_weight[0],
              expect(p0.layers[0].norm1_weight[0], g.layers[0].norm1_weight[0], false), 1e-15)
      << "norms are not decayed";
  EXPECT_EQ(adam.step, 2);
}

TEST(TrainOptim, AveragedWeightsFollowTheirFormula) {
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.999, 1), 2.0 / 11.0);
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.999, 80), 0.9);
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.999, 1000000), 0.999);
  EXPECT_DOUBLE_EQ(tr::ema_decay(0.1, 1), 0.1) << "the cap applies from the first step";
  teo::EncoderConfig cfg;
  cfg.num_layers = 1;
  auto avg = teo::Params<double>::init(cfg, 1);
  const auto a0 = avg;
  const auto p = teo::Params<double>::init(cfg, 2);
  tr::ema_update(avg, p, 0.75);
  EXPECT_DOUBLE_EQ(
      avg.layers[0].v_weight[5],
      a0.layers[0].v_weight[5] + 0.25 * (p.layers[0].v_weight[5] - a0.layers[0].v_weight[5]));
  EXPECT_DOUBLE_EQ(avg.head_bias[1], a0.head_bias[1] + 0.25 * (p.head_bias[1] - a0.head_bias[1]));
  tr::ema_update(avg, p, 0.0);
  EXPECT_LE(test_named_max_diff(avg, p), 1e-15) << "decay 0 copies the parameters (to rounding)";
  cfg.num_layers = 2;
  auto other = teo::Params<double>::init(cfg, 3);
  EXPECT_THROW(tr::ema_update(avg, other, 0.5), teo::ShapeError);
}

TrainOptions tiny(const fs::path& lists) {
  TrainOptions o;
  o.apply_json({{"d_model", 8},
                {"num_heads", 2},
                {"d_ff", 16},
                {"num_layers", 1},
                {"batch_size", 16},
                {"accum_steps", 2},
                {"per_language", 40},
                {"warmup_steps", 3},
                {"lr", 0.01},
                {"clip_norm", 0.5},
                {"dropout", 0.1}});  // so that resume must also continue the dropout draws
  o.data.dir = lists.string();
  o.progress = false;
  o.plot = false;
  return o;
}

// The words, the vocabulary and the options completed by them, as `teo train` builds them.
struct Demo {
  tr::Dataset data;
  tr::Vocab vocab;
  TrainOptions options;
  explicit Demo(TrainOptions o)
      : data(tr::load_words(o.data)), vocab(tr::Vocab::build(data.train)) {
    o.model.vocab_size = vocab.size();
    o.model.num_classes = static_cast<teo::index_t>(tr::languages().size());
    options = o;
  }
  // The micro-batches of optimizer step `step` (0-based) of epoch 0, accum_steps of them.
  std::vector<teo::Batch> step_batches(teo::index_t step) const {
    const auto order = tr::epoch_batches(data.train, options.batch_size, options.seed, 0);
    std::vector<teo::Batch> out;
    for (teo::index_t m = 0; m < options.accum_steps; ++m) {
      const auto k = static_cast<std::size_t>(step * options.accum_steps + m) % order.size();
      std::vector<const tr::Example*> ex;
      for (std::size_t i : order[k]) ex.push_back(&data.train[i]);
      out.push_back(tr::make_batch(vocab, ex, options.model.max_len));
    }
    return out;
  }
  template <class Real>
  void train(tr::Trainer<Real>& t, teo::index_t from, teo::index_t to) const {
    for (teo::index_t s = from; s < to; ++s) t.step(step_batches(s));
  }
};

template <class Real>
std::string state_bytes(const tr::TrainState<Real>& s) {
  std::string out;
  auto add = [&](const teo::Params<Real>& p) {
    p.visit([&](const std::string& name, const teo::Tensor<Real>& t) {
      out += name;
      out.append(reinterpret_cast<const char*>(t.data()),
                 static_cast<std::size_t>(t.numel()) * sizeof(Real));
    });
  };
  add(s.params);
  add(s.adam.m);
  add(s.adam.v);
  add(s.ema);
  return out;
}

// A checkpoint written after 3 steps and read back continues to the bits of 6 steps in one run:
// parameters, AdamW moments and averaged weights, with dropout on.
TEST(Trainer, ResumingFromACheckpointGivesTheSameBitsAsOneRun) {
  const Demo run(tiny(teo::test::fake_lists("teo_trainer_resume")));
  tr::Trainer<float> whole(run.options);
  run.train(whole, 0, 6);
  tr::Trainer<float> first(run.options);
  run.train(first, 0, 3);
  const std::string path = (fs::path(::testing::TempDir()) / "teo_trainer_resume.safetensors");
  const tr::Position pos{0, 3 * run.options.accum_steps, first.steps(), first.micro_batches_run()};
  tr::save_checkpoint(path, run.options, run.vocab, first.state(), pos);
  const tr::Checkpoint ck = tr::read_checkpoint(path);
  EXPECT_EQ(ck.position.step, 3);
  EXPECT_EQ(ck.position.micro_total, 6);
  EXPECT_EQ(ck.options.model, run.options.model);
  tr::Trainer<float> second(tr::resume_options(ck, run.options), tr::load_state<float>(ck),
                            ck.position.micro_total);
  run.train(second, 3, 6);
  EXPECT_EQ(second.steps(), 6);
  EXPECT_TRUE(state_bytes(whole.state()) == state_bytes(second.state()));
  EXPECT_FALSE(state_bytes(whole.state()) == state_bytes(first.state()));
  // A changed setting on resume is refused, not silently ignored.
  TrainOptions changed = run.options;
  changed.given = {{"lr", 0.5}};
  EXPECT_THROW(tr::resume_options(ck, changed), teo::ConfigError);
  EXPECT_THROW(tr::load_state<double>(ck), teo::FormatError) << "a float32 checkpoint";
}

// Shards split each micro-batch for parallel passes. Their order of summation is fixed, so the
// thread count cannot change a bit; and in float64 they agree with the whole batch (shards 1) to
// rounding, weighted by size even when the parts are unequal (16 words in 3 parts).
TEST(Trainer, ShardsGiveTheSameBitsOnAnyThreadCountAndAgreeWithTheWholeBatch) {
  const Demo run(tiny(teo::test::fake_lists("teo_trainer_shards")));
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::simd);
  auto train = [&](int threads, teo::index_t shards, auto zero) {
    using Real = decltype(zero);
    teo::set_num_threads(threads);
    TrainOptions o = run.options;
    o.shards = shards;
    o.model.dropout = std::is_same_v<Real, double> ? 0.0 : 0.1;
    tr::Trainer<Real> t(o);
    run.train(t, 0, 8);
    return t.state();
  };
  const std::string one = state_bytes(train(1, 3, 0.0f));
  EXPECT_TRUE(one == state_bytes(train(2, 3, 0.0f))) << "1 vs 2 threads";
  EXPECT_TRUE(one == state_bytes(train(7, 3, 0.0f))) << "1 vs 7 threads";
  EXPECT_FALSE(one == state_bytes(train(2, 1, 0.0f)))
      << "the shards are different dropout draws, so the bits differ from shards 1";

  const auto whole = train(2, 1, 0.0);
  const auto parts = train(2, 3, 0.0);
  std::vector<std::pair<std::string, const teo::Tensor<double>*>> w;
  whole.params.visit(
      [&](const std::string& n, const teo::Tensor<double>& t) { w.emplace_back(n, &t); });
  std::size_t k = 0;
  parts.params.visit([&](const std::string& n, const teo::Tensor<double>& p) {
    const auto& ref = *w[k++].second;
    double scale = 0, diff = 0;
    for (teo::index_t i = 0; i < p.numel(); ++i) {
      scale = std::max(scale, std::abs(ref[i]));
      diff = std::max(diff, std::abs(ref[i] - p[i]));
    }
    EXPECT_LE(diff, 1e-9 * std::max(scale, 1e-3)) << n;
  });
  EXPECT_EQ(k, w.size());
}

// The averaged weights are what evaluation and prediction use, and checkpoints keep them; ema 0
// keeps none and evaluates the last weights.
TEST(Trainer, AveragedWeightsAreEvaluatedCheckpointedAndUsedForPrediction) {
  const Demo run(tiny(teo::test::fake_lists("teo_trainer_ema")));
  tr::Trainer<float> t(run.options);
  run.train(t, 0, 5);
  EXPECT_EQ(&t.evaluated(), &t.state().ema);
  EXPECT_NE(t.state().ema.head_weight[0], t.params().head_weight[0]);
  const auto batches =
      tr::batches_in_order(run.vocab, run.data.valid, 7, run.options.model.max_len);
  const tr::Evaluation e = t.evaluate(batches);
  teo::index_t counted = 0;
  for (const auto& row : e.confusion)
    for (teo::index_t n : row) counted += n;
  EXPECT_EQ(counted, static_cast<teo::index_t>(run.data.valid.size()));
  EXPECT_GT(e.loss, 0.0);
  // predict gives the class probabilities of the evaluated weights, each row summing to 1.
  const teo::Tensor<float> p = t.predict(batches[0]);
  ASSERT_EQ(p.shape().dims(), (std::vector<std::int64_t>{batches[0].batch, std::int64_t{5}}));
  for (teo::index_t i = 0; i < batches[0].batch; ++i) {
    double sum = 0;
    for (teo::index_t c = 0; c < 5; ++c) sum += p[i * 5 + c];
    EXPECT_NEAR(sum, 1.0, 1e-5);
  }
  const std::string path = (fs::path(::testing::TempDir()) / "teo_trainer_ema.safetensors");
  tr::save_checkpoint(path, run.options, run.vocab, t.state(), {0, 10, 5, 10});
  const tr::Checkpoint ck = tr::read_checkpoint(path);
  const auto from_file = tr::predict_from_checkpoint(ck, batches[0]);
  ASSERT_EQ(from_file.size(), static_cast<std::size_t>(batches[0].batch));
  for (teo::index_t c = 0; c < 5; ++c) EXPECT_EQ(from_file[0][c], static_cast<double>(p[c]));
  // Without the averaged weights in the file, prediction falls back to the last weights.
  auto file = teo::safetensors::read(path);
  std::erase_if(file.tensors, [](const auto& x) { return x.name.starts_with("ema."); });
  const std::string stripped = (fs::path(::testing::TempDir()) / "teo_trainer_noema.safetensors");
  teo::write_file_atomic(stripped, teo::safetensors::serialize(file), true);
  const auto last_weights = tr::predict_from_checkpoint(tr::read_checkpoint(stripped), batches[0]);
  EXPECT_NE(last_weights[0], from_file[0]);
  TrainOptions none = run.options;
  none.ema = 0;
  tr::Trainer<float> last(none);
  run.train(last, 0, 2);
  EXPECT_EQ(&last.evaluated(), &last.params());
  EXPECT_EQ(last.state().ema.count(), 0);
}

TEST(TrainRun, BadSettingsAreNamed) {
  TrainOptions o;
  EXPECT_THROW(o.apply_json({{"vocab_size", 10}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"no_such_key", 1}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"lr", "fast"}}), teo::ConfigError);
  o.apply_json({{"batch_size", 0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o = TrainOptions{};
  o.apply_json({{"shards", 0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o = TrainOptions{};
  o.apply_json({{"ema", 1.0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  EXPECT_THROW(tr::parse_flag_value({"epochs", "int", ""}, "3x"), teo::ConfigError);
  EXPECT_EQ(tr::parse_flag_value({"lr", "real", ""}, "0.5"), 0.5);
  // --seed arrives as a signed integer from the command line and unsigned from a JSON file.
  o = TrainOptions{};
  o.apply_json({{"seed", tr::parse_flag_value({"seed", "int", ""}, "5")}});
  EXPECT_EQ(o.seed, 5u);
  o.apply_json(nlohmann::json::parse(R"({"seed": 18446744073709551615})"));
  EXPECT_EQ(o.seed, 18446744073709551615u);
  EXPECT_THROW(o.apply_json({{"seed", -1}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"seed", 1.5}}), teo::ConfigError);
  EXPECT_EQ(tr::parse_flag_value({"norm_first", "bool", ""}, "false"), false);
}

}  // namespace
