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

#include "cli/run_cli.hpp"

#include "teo/backend.hpp"
#include "teo/cli/train.hpp"
#include "teo/safetensors.hpp"
#include "teo/train.hpp"

namespace {

namespace fs = std::filesystem;
namespace tr = teo::train;
using teo::cli::TrainOptions;

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

// Five small word lists in a fresh directory: each language's words carry a telltale suffix, and
// "shared" and "casa" appear in two lists.
fs::path fake_lists(const std::string& name, int per_language = 60) {
  const fs::path dir = fs::path(::testing::TempDir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const char* suffix[] = {"ing", "ung", "eau", "ción", "zione"};
  for (std::size_t l = 0; l < tr::languages().size(); ++l) {
    std::ofstream out(dir / tr::languages()[l].file);
    for (int i = 0; i < per_language; ++i) {
      std::string stem;
      for (int k = i; k > 0 || stem.empty(); k /= 7) stem.push_back(static_cast<char>('a' + k % 7));
      out << stem << suffix[l] << "\n";
    }
    out << "shared\n";
    if (l == 3 || l == 4) out << "casa\n";
  }
  return dir;
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
  const fs::path dir = fake_lists("teo_train_lists");
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
  const fs::path dir = fake_lists("teo_train_missing");
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
  opts.dir = fake_lists("teo_train_nb").string();
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

TrainOptions tiny(const fs::path& lists, const fs::path& out) {
  TrainOptions o = TrainOptions::defaults();
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
  o.out_dir = out.string();
  o.progress = false;
  o.plot = false;
  return o;
}

std::string param_bytes(const std::string& checkpoint) {
  std::string s;
  for (const auto& t : teo::safetensors::read(checkpoint).tensors) {
    if (t.name.starts_with("param.") || t.name.starts_with("adam.") || t.name.starts_with("ema.")) {
      s += t.name;
      s.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    }
  }
  return s;
}

TEST(TrainRun, ResumingAfterOneEpochGivesTheSameBitsAsTwoEpochsInOneRun) {
  const fs::path lists = fake_lists("teo_train_resume");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_resume_out";
  fs::remove_all(root);
  std::ostringstream log;
  TrainOptions both = tiny(lists, root / "both");
  both.epochs = 2;
  ASSERT_EQ(teo::cli::run_train(both, log), 0);
  TrainOptions first = tiny(lists, root / "split");
  first.epochs = 1;
  ASSERT_EQ(teo::cli::run_train(first, log), 0);
  TrainOptions second = tiny(lists, root / "split");
  second.epochs = 2;
  second.resume = (root / "split" / "checkpoint-epoch1.safetensors").string();
  second.given = {{"epochs", 2}};
  ASSERT_EQ(teo::cli::run_train(second, log), 0);
  const std::string a = param_bytes((root / "both" / "checkpoint-epoch2.safetensors").string());
  const std::string b = param_bytes((root / "split" / "checkpoint-epoch2.safetensors").string());
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "parameters and optimizer state differ after resume";
  EXPECT_FALSE(a == param_bytes((root / "both" / "checkpoint-epoch1.safetensors").string()));
  EXPECT_TRUE(fs::exists(root / "both" / "metrics.csv"));
  EXPECT_TRUE(fs::exists(root / "both" / "summary.json"));
  // A changed setting on resume is refused, not silently ignored.
  TrainOptions changed = second;
  changed.given = {{"lr", 0.5}};
  EXPECT_THROW(teo::cli::run_train(changed, log), teo::ConfigError);
}

// The tensors of a checkpoint whose name starts with `prefix`, as doubles.
std::map<std::string, std::vector<double>> tensors(const std::string& checkpoint,
                                                   const std::string& prefix) {
  std::map<std::string, std::vector<double>> m;
  for (const auto& t : teo::safetensors::read(checkpoint).tensors) {
    if (!t.name.starts_with(prefix)) continue;
    if (t.dtype == teo::safetensors::DType::F64) {
      m[t.name] = t.values<double>();
    } else {
      const auto f = t.values<float>();
      m[t.name].assign(f.begin(), f.end());
    }
  }
  return m;
}

// Shards split each micro-batch for parallel passes. Their order of summation is fixed, so the
// thread count cannot change a bit; and in float64 they agree with the whole batch (shards 1) to
// rounding, weighted by size even when the parts are unequal (16 words in 3 parts).
TEST(TrainRun, ShardsGiveTheSameBitsOnAnyThreadCountAndAgreeWithTheWholeBatch) {
  const fs::path lists = fake_lists("teo_train_shards");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_shards_out";
  fs::remove_all(root);
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::simd);
  std::ostringstream log;
  auto run = [&](const std::string& name, int threads, teo::index_t shards, bool f64) {
    teo::set_num_threads(threads);
    TrainOptions o = tiny(lists, root / name);
    o.shards = shards;
    o.epochs = 1;
    o.model.dropout = f64 ? 0.0 : 0.1;
    if (f64) o.dtype = "float64";
    EXPECT_EQ(teo::cli::run_train(o, log), 0);
    return (root / name / "checkpoint.safetensors").string();
  };
  const std::string one = run("t1", 1, 3, false);
  const std::string two = run("t2", 2, 3, false);
  const std::string seven = run("t7", 7, 3, false);
  ASSERT_FALSE(param_bytes(one).empty());
  EXPECT_TRUE(param_bytes(one) == param_bytes(two)) << "1 vs 2 threads";
  EXPECT_TRUE(param_bytes(one) == param_bytes(seven)) << "1 vs 7 threads";
  EXPECT_FALSE(param_bytes(one) == param_bytes(run("s1", 2, 1, false)))
      << "the shards are different dropout draws, so the bits differ from shards 1";

  const auto whole = tensors(run("w64", 2, 1, true), "param.");
  const auto parts = tensors(run("p64", 2, 3, true), "param.");
  ASSERT_EQ(whole.size(), parts.size());
  for (const auto& [name, w] : whole) {
    const auto& p = parts.at(name);
    ASSERT_EQ(w.size(), p.size()) << name;
    double scale = 0, diff = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      scale = std::max(scale, std::abs(w[i]));
      diff = std::max(diff, std::abs(w[i] - p[i]));
    }
    EXPECT_LE(diff, 1e-9 * std::max(scale, 1e-3)) << name;
  }
}

// The averaged weights are kept in every checkpoint, and predict uses them; ema 0 keeps none.
TEST(TrainRun, AveragedWeightsAreCheckpointedAndUsedForPrediction) {
  const fs::path lists = fake_lists("teo_train_ema");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_ema_out";
  fs::remove_all(root);
  std::ostringstream log;
  TrainOptions o = tiny(lists, root / "ema");
  o.epochs = 1;
  ASSERT_EQ(teo::cli::run_train(o, log), 0);
  const std::string ck = (root / "ema" / "checkpoint.safetensors").string();
  const auto avg = tensors(ck, "ema.");
  const auto last = tensors(ck, "param.");
  ASSERT_EQ(avg.size(), last.size());
  EXPECT_NE(avg.at("ema.head.weight"), last.at("param.head.weight"));
  o = tiny(lists, root / "none");
  o.epochs = 1;
  o.ema = 0;
  ASSERT_EQ(teo::cli::run_train(o, log), 0);
  EXPECT_TRUE(tensors((root / "none" / "checkpoint.safetensors").string(), "ema.").empty());
  // predict on the checkpoint with averaged weights gives the averaged model's probabilities:
  // they differ from those of a copy of the checkpoint without them.
  std::ostringstream with, without;
  ASSERT_EQ(teo::cli::run_predict(ck, {"abcing", "zzzione"}, with), 0);
  auto file = teo::safetensors::read(ck);
  std::erase_if(file.tensors, [](const auto& t) { return t.name.starts_with("ema."); });
  const std::string stripped = (root / "stripped.safetensors").string();
  teo::safetensors::write_file_atomic(stripped, teo::safetensors::serialize(file), true);
  ASSERT_EQ(teo::cli::run_predict(stripped, {"abcing", "zzzione"}, without), 0);
  EXPECT_NE(with.str(), without.str());
}

TEST(TrainRun, BadSettingsAreNamed) {
  TrainOptions o = TrainOptions::defaults();
  EXPECT_THROW(o.apply_json({{"vocab_size", 10}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"no_such_key", 1}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"lr", "fast"}}), teo::ConfigError);
  o.apply_json({{"batch_size", 0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o = TrainOptions::defaults();
  o.apply_json({{"shards", 0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  o = TrainOptions::defaults();
  o.apply_json({{"ema", 1.0}});
  EXPECT_THROW(o.validate(), teo::ConfigError);
  EXPECT_THROW(teo::cli::parse_flag_value({"epochs", "int", ""}, "3x"), teo::ConfigError);
  EXPECT_EQ(teo::cli::parse_flag_value({"lr", "real", ""}, "0.5"), 0.5);
  // --seed arrives as a signed integer from the command line and unsigned from a JSON file.
  o = TrainOptions::defaults();
  o.apply_json({{"seed", teo::cli::parse_flag_value({"seed", "int", ""}, "5")}});
  EXPECT_EQ(o.seed, 5u);
  o.apply_json(nlohmann::json::parse(R"({"seed": 18446744073709551615})"));
  EXPECT_EQ(o.seed, 18446744073709551615u);
  EXPECT_THROW(o.apply_json({{"seed", -1}}), teo::ConfigError);
  EXPECT_THROW(o.apply_json({{"seed", 1.5}}), teo::ConfigError);
  EXPECT_EQ(teo::cli::parse_flag_value({"norm_first", "bool", ""}, "false"), false);
}

using teo::test::CliResult;
using teo::test::run_cli;

TEST(TrainCli, TrainsPredictsAndNamesBadInput) {
  const fs::path lists = fake_lists("teo_train_cli");
  const fs::path out = fs::path(::testing::TempDir()) / "teo_train_cli_out";
  fs::remove_all(out);
  CliResult r = run_cli("train --data-dir " + lists.string() + " --out " + out.string() +
                        " --d-model 8 --num-heads 2 --d-ff 16 --num-layers 1 --per-language 40"
                        " --epochs 2 --batch-size 16 --lr 0.02 --warmup-steps 2 --no-plot");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* part :
       {"validation loss", "test accuracy", "naive Bayes", "confusion matrix", "tok/s", "ETA"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  r = run_cli("predict --checkpoint " + (out / "checkpoint.safetensors").string() +
              " abcing abczione");
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream lines(r.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    ++n;
    double total = 0;
    for (const char* code : {" en ", " de ", " fr ", " es ", " it "}) {
      const auto at = line.find(code);
      ASSERT_NE(at, std::string::npos) << line;
      total += std::stod(line.substr(at + 4));
    }
    EXPECT_NEAR(total, 1.0, 0.01) << line;
  }
  EXPECT_EQ(n, 2);
  r = run_cli("train --data-dir /nonexistent --out " + out.string() + " --no-plot");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("apt-get install wamerican"), std::string::npos) << r.out;
  r = run_cli("train --help");
  EXPECT_EQ(r.code, 0);
  for (const char* part : {"--lr TEXT", "default 0.004", "--shards TEXT", "--ema TEXT",
                           "--pooling TEXT", "default mean"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  r = run_cli("train --epochs 3x");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--epochs takes an integer"), std::string::npos) << r.out;
  r = run_cli("predict --checkpoint " + (lists / "french").string() + " mot");
  EXPECT_EQ(r.code, 2) << "a file that is not a checkpoint";
}

}  // namespace
