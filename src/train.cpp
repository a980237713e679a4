#include "teo/train.hpp"

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

// ---- optimisation ----------------------------------------------------------------------------

double learning_rate(const OptimOptions& o, index_t step) {
  const double n = static_cast<double>(std::max<index_t>(step, 1));
  const double w = static_cast<double>(std::max<index_t>(o.warmup_steps, 1));
  return o.lr * std::min(n / w, std::sqrt(w / n));
}

template <class Real>
double global_norm(const Params<Real>& grads) {
  double sum = 0;
  grads.visit([&](const std::string&, const Tensor<Real>& g) {
    for (index_t i = 0; i < g.numel(); ++i)
      sum += static_cast<double>(g[i]) * static_cast<double>(g[i]);
  });
  return std::sqrt(sum);
}

template <class Real>
void clip_by_norm(Params<Real>& grads, double norm, double max_norm) {
  if (max_norm <= 0) return;
  const Real coef = static_cast<Real>(std::min(max_norm / (norm + 1e-6), 1.0));
  grads.visit([&](const std::string&, Tensor<Real>& g) {
    for (index_t i = 0; i < g.numel(); ++i) g[i] *= coef;
  });
}

template <class Real>
AdamW<Real> AdamW<Real>::zeros(const EncoderConfig& cfg) {
  return AdamW{Params<Real>::zeros(cfg), Params<Real>::zeros(cfg), 0};
}

template <class Real>
void AdamW<Real>::update(Params<Real>& params, const Params<Real>& grads, const OptimOptions& o,
                         double lr) {
  ++step;
  std::vector<Tensor<Real>*> ps, ms, vs;
  std::vector<const Tensor<Real>*> gs;
  params.visit([&](const std::string&, Tensor<Real>& t) { ps.push_back(&t); });
  m.visit([&](const std::string&, Tensor<Real>& t) { ms.push_back(&t); });
  v.visit([&](const std::string&, Tensor<Real>& t) { vs.push_back(&t); });
  grads.visit([&](const std::string&, const Tensor<Real>& t) { gs.push_back(&t); });
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  const Real step_size = static_cast<Real>(lr / bc1);
  const Real bc2_sqrt = static_cast<Real>(std::sqrt(bc2));
  const Real b1 = static_cast<Real>(o.beta1), b2 = static_cast<Real>(o.beta2);
  const Real one_b1 = static_cast<Real>(1.0 - o.beta1), one_b2 = static_cast<Real>(1.0 - o.beta2);
  const Real eps = static_cast<Real>(o.adam_eps);
  for (std::size_t k = 0; k < ps.size(); ++k) {
    Tensor<Real>& p = *ps[k];
    const Real decay = decays(p) ? static_cast<Real>(1.0 - lr * o.weight_decay) : Real(1);
    for (index_t i = 0; i < p.numel(); ++i) {
      const Real g = (*gs[k])[i];
      Real& mi = (*ms[k])[i];
      Real& vi = (*vs[k])[i];
      p[i] *= decay;
      mi = mi * b1 + g * one_b1;
      vi = vi * b2 + (g * g) * one_b2;
      const Real denom = std::sqrt(vi) / bc2_sqrt + eps;
      p[i] += -step_size * (mi / denom);
    }
  }
}

double ema_decay(double decay, index_t step) {
  const double n = static_cast<double>(step);
  return std::min(decay, (1.0 + n) / (10.0 + n));
}

template <class Real>
void ema_update(Params<Real>& avg, const Params<Real>& params, double decay) {
  const Real rate = static_cast<Real>(1.0 - decay);
  for_each_pair(avg, params, "averaged weights", [&](Tensor<Real>& a, const Tensor<Real>& p) {
    for (index_t i = 0; i < a.numel(); ++i) a[i] += rate * (p[i] - a[i]);
  });
}

template double global_norm(const Params<float>&);
template double global_norm(const Params<double>&);
template void clip_by_norm(Params<float>&, double, double);
template void clip_by_norm(Params<double>&, double, double);
template struct AdamW<float>;
template struct AdamW<double>;
template void ema_update(Params<float>&, const Params<float>&, double);
template void ema_update(Params<double>&, const Params<double>&, double);

}  // namespace teo::train
