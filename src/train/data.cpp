#include "teo/train/data.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "teo/rng.hpp"

namespace teo::train {

const std::vector<Language>& languages() {
  static const std::vector<Language> langs = {
      {"en", "English", "american-english", "wamerican"},
      {"de", "German", "ngerman", "wngerman"},
      {"fr", "French", "french", "wfrench"},
      {"es", "Spanish", "spanish", "wspanish"},
      {"it", "Italian", "italian", "witalian"},
  };
  return langs;
}

std::u32string utf8_decode(const std::string& s, bool* ok) {
  static constexpr char32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  std::u32string out;
  bool good = true;
  for (std::size_t i = 0; good && i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    char32_t cp = c;
    if (c >= 0x80) {
      if ((c >> 5) == 0x6)
        n = 1, cp = c & 0x1f;
      else if ((c >> 4) == 0xe)
        n = 2, cp = c & 0x0f;
      else if ((c >> 3) == 0x1e)
        n = 3, cp = c & 0x07;
      else
        good = false;
    }
    if (!good || i + n >= s.size()) {
      good = false;
      break;
    }
    for (std::size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) good = false;
      cp = (cp << 6) | (d & 0x3f);
    }
    if (!good || cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      good = false;
      break;
    }
    out.push_back(cp);
    i += n + 1;
  }
  if (ok) *ok = good;
  if (!good) out.clear();
  return out;
}

std::string utf8_encode(const std::u32string& s) {
  std::string out;
  for (char32_t c : s) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x800) {
      out.push_back(static_cast<char>(0xc0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    } else if (c < 0x10000) {
      out.push_back(static_cast<char>(0xe0 | (c >> 12)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    } else {
      out.push_back(static_cast<char>(0xf0 | (c >> 18)));
      out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
      out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
    }
  }
  return out;
}

namespace {

std::uint64_t word_hash(const std::string& utf8, const char* purpose) {
  return rng::mix64(rng::stream_id(utf8) ^ rng::stream_id(purpose));
}

}  // namespace

Dataset load_words(const DataOptions& opts) {
  if (opts.per_language < 10) {
    throw ConfigError("per_language must be at least 10, got " + std::to_string(opts.per_language));
  }
  const auto& langs = languages();
  std::vector<std::set<std::string>> lists(langs.size());
  for (std::size_t l = 0; l < langs.size(); ++l) {
    const std::string path = (std::filesystem::path(opts.dir) / langs[l].file).string();
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      throw InputError(std::string("word list ") + path + " (" + langs[l].name +
                       ") is missing: install it with `apt-get install " + langs[l].package + "`");
    }
    std::string line;
    index_t lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
      if (line.empty()) continue;
      bool ok = true;
      utf8_decode(line, &ok);
      if (!ok) {
        throw InputError(path + ":" + std::to_string(lineno) + ": not UTF-8 (reinstall " +
                         langs[l].package + ")");
      }
      lists[l].insert(line);
    }
    if (lists[l].empty()) throw InputError("word list " + path + " is empty");
  }
  std::map<std::string, int> count;
  for (const auto& list : lists) {
    for (const auto& w : list) ++count[w];
  }
  Dataset d;
  for (std::size_t l = 0; l < langs.size(); ++l) {
    std::vector<std::pair<std::uint64_t, const std::string*>> words;
    index_t shared = 0;
    for (const auto& w : lists[l]) {
      if (count[w] > 1) {
        ++shared;
        continue;
      }
      words.emplace_back(word_hash(w, "select"), &w);
    }
    std::sort(words.begin(), words.end());
    if (static_cast<index_t>(words.size()) > opts.per_language) {
      words.resize(static_cast<std::size_t>(opts.per_language));
    }
    d.dropped_shared.push_back(shared);
    d.kept.push_back(static_cast<index_t>(words.size()));
    for (const auto& [h, w] : words) {
      (void)h;
      Example e{utf8_decode(*w), static_cast<int>(l)};
      const auto bucket = word_hash(*w, "split") % 10;
      (bucket < 8 ? d.train : bucket == 8 ? d.valid : d.test).push_back(std::move(e));
    }
  }
  return d;
}

Vocab Vocab::build(const std::vector<Example>& train) {
  std::set<char32_t> seen;
  for (const auto& e : train) seen.insert(e.word.begin(), e.word.end());
  Vocab v;
  v.chars_.assign(seen.begin(), seen.end());
  return v;
}

nlohmann::json Vocab::to_json() const {
  std::vector<std::uint32_t> cps(chars_.begin(), chars_.end());
  return nlohmann::json{{"specials", {"[PAD]", "[CLS]", "[UNK]", "[SEP]"}}, {"code_points", cps}};
}

Vocab Vocab::from_json(const nlohmann::json& j) {
  Vocab v;
  try {
    for (const auto& c : j.at("code_points")) v.chars_.push_back(c.get<std::uint32_t>());
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(std::string("vocabulary: ") + e.what());
  }
  if (!std::is_sorted(v.chars_.begin(), v.chars_.end())) {
    throw FormatError("vocabulary: code points are not sorted");
  }
  return v;
}

std::int64_t Vocab::id(char32_t c) const {
  const auto it = std::lower_bound(chars_.begin(), chars_.end(), c);
  if (it == chars_.end() || *it != c) return unk;
  return num_special + (it - chars_.begin());
}

std::vector<std::int64_t> Vocab::encode(const std::u32string& word, index_t max_len) const {
  std::vector<std::int64_t> ids = {cls};
  for (char32_t c : word) {
    if (static_cast<index_t>(ids.size()) + 1 >= max_len) break;
    ids.push_back(id(c));
  }
  ids.push_back(sep);
  return ids;
}

Batch make_batch(const Vocab& vocab, const std::vector<const Example*>& examples, index_t max_len) {
  std::vector<std::vector<std::int64_t>> ids;
  index_t S = 1;
  for (const auto* e : examples) {
    ids.push_back(vocab.encode(e->word, max_len));
    S = std::max(S, static_cast<index_t>(ids.back().size()));
  }
  Batch b;
  b.batch = static_cast<index_t>(examples.size());
  b.seq_len = S;
  b.tokens.assign(static_cast<std::size_t>(b.batch * S), Vocab::pad);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::copy(ids[i].begin(), ids[i].end(), b.tokens.begin() + static_cast<std::ptrdiff_t>(i) * S);
    b.lengths.push_back(static_cast<std::int64_t>(ids[i].size()));
    b.labels.push_back(examples[i]->label);
  }
  return b;
}

Batch encode_words(const Vocab& vocab, const std::vector<std::string>& words, index_t max_len) {
  std::vector<Example> ex;
  for (const auto& w : words) {
    bool ok = true;
    auto cps = utf8_decode(w, &ok);
    if (!ok) throw InputError("word \"" + w + "\" is not valid UTF-8");
    if (cps.empty()) throw InputError("an empty word cannot be classified");
    ex.push_back({std::move(cps), 0});
  }
  std::vector<const Example*> ptrs;
  ptrs.reserve(ex.size());
  for (const auto& e : ex) ptrs.push_back(&e);
  return make_batch(vocab, ptrs, max_len);
}

namespace {

// A permutation of [0, n) for one epoch, from the seed (Fisher-Yates over the counter generator).
std::vector<std::size_t> epoch_order(std::size_t n, std::uint64_t seed, index_t epoch) {
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  const auto stream = rng::stream_id("train.shuffle." + std::to_string(epoch));
  for (std::size_t i = n; i-- > 1;) {
    const std::size_t j = static_cast<std::size_t>(rng::bits(seed, stream, i) % (i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

}  // namespace

std::vector<std::vector<std::size_t>> epoch_batches(const std::vector<Example>& set,
                                                    index_t batch_size, std::uint64_t seed,
                                                    index_t epoch) {
  const auto order = epoch_order(set.size(), seed, epoch);
  const std::size_t bs = static_cast<std::size_t>(batch_size);
  const std::size_t window = 50 * bs;
  std::vector<std::vector<std::size_t>> batches;
  for (std::size_t w = 0; w < order.size(); w += window) {
    std::vector<std::size_t> chunk(
        order.begin() + static_cast<std::ptrdiff_t>(w),
        order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), w + window)));
    std::stable_sort(chunk.begin(), chunk.end(), [&](std::size_t a, std::size_t b) {
      return set[a].word.size() < set[b].word.size();
    });
    for (std::size_t i = 0; i < chunk.size(); i += bs) {
      batches.emplace_back(
          chunk.begin() + static_cast<std::ptrdiff_t>(i),
          chunk.begin() + static_cast<std::ptrdiff_t>(std::min(chunk.size(), i + bs)));
    }
  }
  const auto perm = epoch_order(batches.size(), seed ^ 0x9e3779b97f4a7c15ULL, epoch);
  std::vector<std::vector<std::size_t>> out(batches.size());
  for (std::size_t i = 0; i < perm.size(); ++i) out[i] = std::move(batches[perm[i]]);
  return out;
}

std::vector<Batch> batches_in_order(const Vocab& vocab, const std::vector<Example>& set,
                                    index_t batch_size, index_t max_len) {
  const std::size_t bs = static_cast<std::size_t>(std::max<index_t>(batch_size, 1));
  std::vector<Batch> out;
  for (std::size_t first = 0; first < set.size(); first += bs) {
    std::vector<const Example*> ex;
    for (std::size_t i = first; i < std::min(set.size(), first + bs); ++i) ex.push_back(&set[i]);
    out.push_back(make_batch(vocab, ex, max_len));
  }
  return out;
}

// ---- naive Bayes -----------------------------------------------------------------------------

namespace {

std::vector<std::u32string> trigrams(const std::u32string& word) {
  const std::u32string w = U"^^" + word + U"$";
  std::vector<std::u32string> out;
  for (std::size_t i = 0; i + 3 <= w.size(); ++i) out.push_back(w.substr(i, 3));
  return out;
}

}  // namespace

void NaiveBayes::fit(const std::vector<Example>& train, int num_classes) {
  classes_ = num_classes;
  std::unordered_map<std::u32string, std::vector<double>> counts;
  std::vector<double> total(static_cast<std::size_t>(num_classes), 0.0);
  std::vector<double> docs(static_cast<std::size_t>(num_classes), 0.0);
  for (const auto& e : train) {
    docs[static_cast<std::size_t>(e.label)] += 1;
    for (const auto& t : trigrams(e.word)) {
      auto& c = counts[t];
      if (c.empty()) c.assign(static_cast<std::size_t>(num_classes), 0.0);
      c[static_cast<std::size_t>(e.label)] += 1;
      total[static_cast<std::size_t>(e.label)] += 1;
    }
  }
  const double vocab = static_cast<double>(counts.size()) + 1;  // + the unseen trigram
  log_prior_.assign(static_cast<std::size_t>(num_classes), 0.0);
  log_unseen_.assign(static_cast<std::size_t>(num_classes), 0.0);
  for (std::size_t k = 0; k < log_prior_.size(); ++k) {
    log_prior_[k] = std::log((docs[k] + 1) / (static_cast<double>(train.size()) + num_classes));
    log_unseen_[k] = std::log(1.0 / (total[k] + vocab));
  }
  log_prob_.clear();
  for (auto& [t, c] : counts) {
    std::vector<double> lp(c.size());
    for (std::size_t k = 0; k < c.size(); ++k) lp[k] = std::log((c[k] + 1) / (total[k] + vocab));
    log_prob_.emplace(t, std::move(lp));
  }
}

int NaiveBayes::predict(const std::u32string& word) const {
  std::vector<double> score = log_prior_;
  for (const auto& t : trigrams(word)) {
    const auto it = log_prob_.find(t);
    for (std::size_t k = 0; k < score.size(); ++k) {
      score[k] += it == log_prob_.end() ? log_unseen_[k] : it->second[k];
    }
  }
  return static_cast<int>(std::max_element(score.begin(), score.end()) - score.begin());
}

double NaiveBayes::accuracy(const std::vector<Example>& set) const {
  if (set.empty()) return 0;
  index_t correct = 0;
  for (const auto& e : set) correct += predict(e.word) == e.label;
  return static_cast<double>(correct) / static_cast<double>(set.size());
}

namespace {

std::uint64_t key2(std::int64_t a, std::int64_t b) {
  return (static_cast<std::uint64_t>(a) << 21) | static_cast<std::uint64_t>(b);
}
std::uint64_t key3(std::int64_t a, std::int64_t b, std::int64_t x) {
  return (static_cast<std::uint64_t>(a) << 42) | key2(b, x);
}

// Calls f(a, b, x) for every predicted token x of the word's sequence, with its two predecessors.
template <class F>
void each_prediction(const Vocab& vocab, const Example& e, index_t max_len, F&& f) {
  const auto ids = vocab.encode(e.word, max_len);
  for (std::size_t t = 1; t < ids.size(); ++t)
    f(t >= 2 ? ids[t - 2] : Vocab::cls, ids[t - 1], ids[t]);
}

}  // namespace

void TrigramLM::fit(const Vocab& vocab, const std::vector<Example>& train,
                    const std::vector<Example>& valid, index_t max_len) {
  vocab_ = &vocab;
  max_len_ = max_len;
  tri_.clear();
  tri_ctx_.clear();
  bi_.clear();
  bi_ctx_.clear();
  uni_.assign(static_cast<std::size_t>(vocab.size()), 0.0);
  n_ = 0;
  for (const auto& e : train) {
    each_prediction(vocab, e, max_len, [&](std::int64_t a, std::int64_t b, std::int64_t x) {
      tri_[key3(a, b, x)] += 1;
      tri_ctx_[key2(a, b)] += 1;
      bi_[key2(b, x)] += 1;
      bi_ctx_[static_cast<std::uint64_t>(b)] += 1;
      uni_[static_cast<std::size_t>(x)] += 1;
      ++n_;
    });
  }
  // The interpolation weights: the grid point with the least validation loss (the first on ties).
  const std::array<std::array<double, 3>, 6> grid = {{{0.8, 0.15, 0.05},
                                                      {0.7, 0.2, 0.1},
                                                      {0.6, 0.3, 0.1},
                                                      {0.5, 0.35, 0.15},
                                                      {0.4, 0.4, 0.2},
                                                      {0.3, 0.4, 0.3}}};
  double best = INFINITY;
  std::array<double, 3> chosen = grid[0];
  for (const auto& w : grid) {
    w_ = w;
    const double loss = nll(valid).first;
    if (loss < best) {
      best = loss;
      chosen = w;
    }
  }
  w_ = chosen;
}

double TrigramLM::log_prob(std::int64_t a, std::int64_t b, std::int64_t x) const {
  const auto V = static_cast<double>(vocab_->size());
  double p = 0, carry = 0;  // carry: the weight of an order whose context was never seen
  const auto find = [](const auto& m, std::uint64_t k) {
    const auto it = m.find(k);
    return it == m.end() ? 0.0 : it->second;
  };
  const double c_ab = find(tri_ctx_, key2(a, b));
  if (c_ab > 0) {
    p += w_[0] * find(tri_, key3(a, b, x)) / c_ab;
  } else {
    carry += w_[0];
  }
  const double c_b = find(bi_ctx_, static_cast<std::uint64_t>(b));
  if (c_b > 0) {
    p += (w_[1] + carry) * find(bi_, key2(b, x)) / c_b;
    carry = 0;
  } else {
    carry += w_[1];
  }
  p += (w_[2] + carry) * (uni_[static_cast<std::size_t>(x)] + 1) / (static_cast<double>(n_) + V);
  return std::log(p);
}

std::pair<double, index_t> TrigramLM::nll(const std::vector<Example>& set) const {
  double total = 0;
  index_t count = 0;
  for (const auto& e : set) {
    each_prediction(*vocab_, e, max_len_, [&](std::int64_t a, std::int64_t b, std::int64_t x) {
      total -= log_prob(a, b, x);
      ++count;
    });
  }
  return {count > 0 ? total / static_cast<double>(count) : 0.0, count};
}

double TrigramLM::perplexity(const std::vector<Example>& set) const {
  return std::exp(nll(set).first);
}

}  // namespace teo::train
