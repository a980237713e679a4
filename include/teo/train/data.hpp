// The training demo's data: five Debian word lists, a code-point vocabulary, batches padded to
// their longest word, the epoch's shuffled and length-grouped micro-batches, and a
// character-trigram naive Bayes classifier as the yardstick.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "teo/model.hpp"

namespace teo::train {

struct Language {
  const char* code;     // "en"
  const char* name;     // "English"
  const char* file;     // "american-english", under the word-list directory
  const char* package;  // "wamerican", the Debian package that installs it
};
const std::vector<Language>& languages();

struct Example {
  std::u32string word;  // Unicode code points
  int label = 0;        // index into languages()
};

struct Dataset {
  std::vector<Example> train, valid, test;
  std::vector<index_t> dropped_shared;  // per language: words also in another list
  std::vector<index_t> kept;            // per language, after the cap
};

struct DataOptions {
  std::string dir = "/usr/share/dict";
  index_t per_language = 40000;  // the class-balancing cap
};

// Reads the five lists (InputError naming the file and the package to install when one is
// missing or not UTF-8), drops every word found in more than one list, keeps per_language words
// of each chosen by a hash of the word, and splits them by another hash of the word: 80% train,
// 10% validation, 10% test. The same files always give the same split.
Dataset load_words(const DataOptions& opts);

std::u32string utf8_decode(const std::string& s, bool* ok = nullptr);
std::string utf8_encode(const std::u32string& s);

// Token ids: 0 [PAD], 1 [CLS], 2 [UNK], 3 [SEP], then the training set's code points in increasing
// order.
class Vocab {
 public:
  static constexpr std::int64_t pad = 0, cls = 1, unk = 2, sep = 3;
  static constexpr std::int64_t num_special = 4;
  static Vocab build(const std::vector<Example>& train);
  static Vocab from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;
  index_t size() const { return num_special + static_cast<index_t>(chars_.size()); }
  std::int64_t id(char32_t c) const;
  // [CLS], the word's ids, [SEP]: at most max_len tokens (a longer word loses its tail, never the
  // markers). [SEP] marks where the word ends, which is where most of its language shows.
  std::vector<std::int64_t> encode(const std::u32string& word, index_t max_len) const;

 private:
  std::vector<char32_t> chars_;  // sorted
};

// Pads a list of examples to the longest one: tokens (B, S), lengths, labels.
Batch make_batch(const Vocab& vocab, const std::vector<const Example*>& examples, index_t max_len);

// Words given as UTF-8 text, as a batch to classify (labels 0). InputError naming a word that is
// empty or not valid UTF-8.
Batch encode_words(const Vocab& vocab, const std::vector<std::string>& words, index_t max_len);

// The micro-batches of one epoch, as indices into `set`: the shuffled words are cut into windows
// of 50 batches, each window is sorted by word length and sliced into batches of batch_size (so
// that a batch pads little), and the batches are shuffled again. Everything follows from
// (seed, epoch).
std::vector<std::vector<std::size_t>> epoch_batches(const std::vector<Example>& set,
                                                    index_t batch_size, std::uint64_t seed,
                                                    index_t epoch);

// `set` in order, cut into batches of at most batch_size words (for evaluation).
std::vector<Batch> batches_in_order(const Vocab& vocab, const std::vector<Example>& set,
                                    index_t batch_size, index_t max_len);

// Multinomial naive Bayes over character trigrams of "^^word$" with add-one smoothing.
class NaiveBayes {
 public:
  void fit(const std::vector<Example>& train, int num_classes);
  int predict(const std::u32string& word) const;
  // The fraction of `set` it labels right (0 for an empty set).
  double accuracy(const std::vector<Example>& set) const;

 private:
  int classes_ = 0;
  std::vector<double> log_prior_;
  std::vector<double> log_unseen_;  // per class: a trigram never seen with that class
  std::unordered_map<std::u32string, std::vector<double>> log_prob_;
};

// The language-model demo's yardstick: a character-trigram model of the token sequences
// Vocab::encode gives ([CLS], the characters, [SEP]), predicting each token after [CLS] from the
// two before it
// ([CLS] stands in before the start). P(x | a b) = l3 c(abx)/c(ab) + l2 c(bx)/c(b) + l1 (c(x) + 1)
// / (n + V): maximum-likelihood trigram and bigram, add-one unigram over the V ids; an order whose
// context was never seen passes its weight down. The weights (l3, l2, l1) are the grid point with
// the least validation loss.
class TrigramLM {
 public:
  void fit(const Vocab& vocab, const std::vector<Example>& train, const std::vector<Example>& valid,
           index_t max_len);
  // The mean negative log-likelihood (nats) per predicted token over `set`, and the count.
  std::pair<double, index_t> nll(const std::vector<Example>& set) const;
  double perplexity(const std::vector<Example>& set) const;
  std::array<double, 3> weights() const { return w_; }
  // log P(x | a b), for ids in [0, V).
  double log_prob(std::int64_t a, std::int64_t b, std::int64_t x) const;

 private:
  const Vocab* vocab_ = nullptr;
  index_t max_len_ = 0, n_ = 0;
  std::array<double, 3> w_{0.6, 0.3, 0.1};  // trigram, bigram, unigram
  std::unordered_map<std::uint64_t, double> tri_, tri_ctx_, bi_, bi_ctx_;
  std::vector<double> uni_;
};

}  // namespace teo::train
