// teo/train/trainer.hpp and checkpoint.hpp: optimizer steps over sharded micro-batches, bit-exact
// resume from a checkpoint, evaluation and prediction with the averaged weights.
#include <cmath>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "teo/backend.hpp"
#include "teo/files.hpp"
#include "teo/safetensors.hpp"
#include "teo/train.hpp"
#include "train/word_lists.hpp"

namespace {

namespace fs = std::filesystem;
namespace tr = teo::train;
using teo::train::TrainOptions;

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
    o.model.embeddings.vocab_size = vocab.size();
    if (!o.model.decoder())
      o.model.head.num_classes = static_cast<teo::index_t>(tr::languages().size());
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
      out.push_back(tr::make_batch(vocab, ex, options.model.embeddings.max_len));
      if (options.model.decoder()) out.back().labels.clear();  // its targets are its next tokens
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
  // A position that resuming would index with out of bounds is refused by name.
  for (const auto& [bad, why] :
       {std::pair{tr::Position{0, -1, 3, 6}, "micro = -1, below 0"},
        std::pair{tr::Position{-2, 0, 3, 6}, "epoch = -2, below 0"},
        std::pair{tr::Position{0, 3, 7, 6}, "cannot exceed micro_total 6"}}) {
    tr::save_checkpoint(path, run.options, run.vocab, first.state(), bad);
    try {
      tr::read_checkpoint(path);
      ADD_FAILURE() << why;
    } catch (const teo::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
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

// A decoder's shards are weighted by their next tokens, not their words: in float64 three unequal
// parts agree with the whole batch to rounding, and the bits do not depend on the thread count.
TEST(Trainer, DecoderShardsAreWeightedByTheirTokens) {
  TrainOptions o = tiny(teo::test::fake_lists("teo_trainer_lm_shards"));
  o.apply_json({{"architecture", "decoder"}, {"dropout", 0.0}});
  const Demo run(o);
  ASSERT_TRUE(run.options.model.decoder());
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::simd);
  auto train = [&](int threads, teo::index_t shards) {
    teo::set_num_threads(threads);
    TrainOptions opts = run.options;
    opts.shards = shards;
    tr::Trainer<double> t(opts);
    run.train(t, 0, 6);
    return t.state();
  };
  const auto whole = train(2, 1);
  const auto parts = train(1, 3);
  EXPECT_TRUE(state_bytes(parts) == state_bytes(train(2, 3))) << "1 vs 2 threads";
  std::vector<const teo::Tensor<double>*> w;
  whole.params.visit([&](const std::string&, const teo::Tensor<double>& t) { w.push_back(&t); });
  std::size_t k = 0;
  parts.params.visit([&](const std::string& n, const teo::Tensor<double>& p) {
    const auto& ref = *w[k++];
    double scale = 0, diff = 0;
    for (teo::index_t i = 0; i < p.numel(); ++i) {
      scale = std::max(scale, std::abs(ref[i]));
      diff = std::max(diff, std::abs(ref[i] - p[i]));
    }
    EXPECT_LE(diff, 1e-9 * std::max(scale, 1e-3)) << n;
  });
  // evaluation: the mean negative log-likelihood per next token, and their count
  tr::Trainer<double> t(run.options);
  std::vector<teo::Batch> valid = tr::batches_in_order(run.vocab, run.data.valid, 64, 32);
  for (auto& b : valid) b.labels.clear();
  const tr::Evaluation e = t.evaluate(valid);
  teo::index_t tokens = 0;
  for (const auto& ex : run.data.valid)
    tokens += static_cast<teo::index_t>(run.vocab.encode(ex.word, 32).size()) - 1;
  EXPECT_EQ(e.predictions, tokens);
  EXPECT_GT(e.loss, 0.0);
  EXPECT_TRUE(e.confusion.empty());
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
      tr::batches_in_order(run.vocab, run.data.valid, 7, run.options.model.embeddings.max_len);
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

}  // namespace
