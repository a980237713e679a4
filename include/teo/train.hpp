// Training: the word-language dataset, its code-point vocabulary, a character-trigram naive Bayes
// baseline, AdamW with PyTorch's semantics, the warmup + inverse-sqrt schedule and global-norm
// gradient clipping. The `teo train` loop that puts them together lives in src/cli/train.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "teo/model.hpp"

namespace teo::train {

// ---- data ----------------------------------------------------------------------------------

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
  index_t per_language = 12000;  // the class-balancing cap
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

// ---- the naive Bayes yardstick ---------------------------------------------------------------

// Multinomial naive Bayes over character trigrams of "^^word$" with add-one smoothing.
class NaiveBayes {
 public:
  void fit(const std::vector<Example>& train, int num_classes);
  int predict(const std::u32string& word) const;

 private:
  int classes_ = 0;
  std::vector<double> log_prior_;
  std::vector<double> log_unseen_;  // per class: a trigram never seen with that class
  std::unordered_map<std::u32string, std::vector<double>> log_prob_;
};

// ---- optimisation ----------------------------------------------------------------------------

struct OptimOptions {
  double lr = 2e-3;
  index_t warmup_steps = 200;
  double weight_decay = 0.01;
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  double clip_norm = 1.0;  // 0: no clipping
};

// lr at optimizer step n (1-based): lr * min(n / warmup, sqrt(warmup / n)).
double learning_rate(const OptimOptions& o, index_t step);

// Whether AdamW decays a parameter: every matrix (2-D), never a bias or a norm (1-D).
template <class Real>
bool decays(const Tensor<Real>& t) {
  return t.shape().rank() >= 2;
}

// The global L2 norm of every gradient (accumulated in double, parameters in canonical order).
template <class Real>
double global_norm(const Params<Real>& grads);

// torch.nn.utils.clip_grad_norm_: coef = min(max_norm / (norm + 1e-6), 1); grads *= coef.
template <class Real>
void clip_by_norm(Params<Real>& grads, double norm, double max_norm);

// torch.optim.AdamW, one step: p *= 1 - lr*wd (matrices only); m = b1 m + (1-b1) g;
// v = b2 v + (1-b2) g^2; p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
template <class Real>
struct AdamW {
  Params<Real> m, v;
  index_t step = 0;
  static AdamW zeros(const EncoderConfig& cfg);
  void update(Params<Real>& params, const Params<Real>& grads, const OptimOptions& o, double lr);
};

// Calls f(a_tensor, b_tensor) for every parameter of `a` and the same-named one of `b`, in
// canonical order; ShapeError naming `what` when the two do not have the same tensors and shapes.
template <class Real, class F>
void for_each_pair(Params<Real>& a, const Params<Real>& b, const std::string& what, F&& f) {
  std::vector<const Tensor<Real>*> bs;
  b.visit([&](const std::string&, const Tensor<Real>& t) { bs.push_back(&t); });
  std::vector<std::pair<std::string, Tensor<Real>*>> as;
  a.visit([&](const std::string& name, Tensor<Real>& t) { as.emplace_back(name, &t); });
  if (as.size() != bs.size()) {
    throw ShapeError(what + ": " + std::to_string(as.size()) + " tensors against " +
                     std::to_string(bs.size()));
  }
  for (std::size_t k = 0; k < as.size(); ++k) {
    if (!(as[k].second->shape() == bs[k]->shape())) {
      throw ShapeError(what + ": " + as[k].first + " has shape " + as[k].second->shape().str() +
                       " against " + bs[k]->shape().str());
    }
  }
  for (std::size_t k = 0; k < as.size(); ++k) f(*as[k].second, *bs[k]);
}

// ---- averaged weights --------------------------------------------------------------------------

// An exponential moving average of the parameters, updated after every optimizer step and used
// for evaluation: it averages out the step-to-step noise that a learning rate decaying only as
// 1/sqrt(step) leaves in the last iterate. The decay at optimizer step n (1-based) is
// min(decay, (1 + n) / (10 + n)), so the average forgets the initialisation quickly.
double ema_decay(double decay, index_t step);

// avg += (1 - decay) * (params - avg), element by element, in Real.
template <class Real>
void ema_update(Params<Real>& avg, const Params<Real>& params, double decay);

}  // namespace teo::train
