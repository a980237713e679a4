// teo/train/data.hpp: UTF-8, the word lists and their split, the vocabulary, batches and the
// naive Bayes yardstick.
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "teo/train/data.hpp"
#include "train/word_lists.hpp"

namespace {

namespace fs = std::filesystem;
namespace tr = teo::train;

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

// The language model's yardstick is a distribution over the vocabulary after any context (seen,
// half seen or never seen), and it learns the lists: far below the uniform model's perplexity V.
TEST(TrainBaseline, TrigramLanguageModelIsADistributionAndLearnsItsLists) {
  tr::DataOptions opts;
  opts.dir = teo::test::fake_lists("teo_train_trigram").string();
  const tr::Dataset d = tr::load_words(opts);
  const tr::Vocab vocab = tr::Vocab::build(d.train);
  tr::TrigramLM lm;
  lm.fit(vocab, d.train, d.valid, 32);
  const auto V = static_cast<std::int64_t>(vocab.size());
  for (const auto& [a, b] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{tr::Vocab::cls, tr::Vocab::cls},
                                                          {tr::Vocab::cls, 4},
                                                          {4, 5},
                                                          {V - 1, V - 1},
                                                          {tr::Vocab::pad, tr::Vocab::sep}}) {
    double total = 0;
    for (std::int64_t x = 0; x < V; ++x) total += std::exp(lm.log_prob(a, b, x));
    EXPECT_NEAR(total, 1.0, 1e-12) << a << " " << b;
  }
  const auto w = lm.weights();
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0, 1e-15);
  const double ppl = lm.perplexity(d.test);
  EXPECT_GT(ppl, 1.0);
  EXPECT_LT(ppl, static_cast<double>(V) / 4) << "no better than a quarter of uniform";
  EXPECT_EQ(lm.nll({}).second, 0);
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

}  // namespace
