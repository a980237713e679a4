#include "teo/train/session.hpp"

#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "teo/files.hpp"

namespace teo::train {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Every place the run will write is checked before the data is read, so that a bad path fails
// in a second, not after the training.
Dataset load_data(const TrainOptions& o) {
  ensure_writable_dir(o.out_dir);
  if (!o.trace.empty()) {
    const std::filesystem::path trace(o.trace);
    std::error_code ec;
    if (std::filesystem::is_directory(trace, ec)) throw FileError(o.trace + ": is a directory");
    ensure_writable_dir(trace.has_parent_path() ? trace.parent_path().string() : ".");
  }
  return load_words(o.data);
}

// The options completed by the data: vocab_size, and an encoder's num_classes.
TrainOptions with_data(TrainOptions o, const Vocab& vocab) {
  o.model.embeddings.vocab_size = vocab.size();
  if (!o.model.decoder()) o.model.head.num_classes = static_cast<index_t>(languages().size());
  return o;
}

// A batch as the model reads it: a decoder's has no labels (its targets are its next tokens).
Batch for_model(Batch b, const ModelConfig& cfg) {
  if (cfg.decoder()) b.labels.clear();
  return b;
}

std::vector<Batch> for_model(std::vector<Batch> batches, const ModelConfig& cfg) {
  for (auto& b : batches) b = for_model(std::move(b), cfg);
  return batches;
}

template <class Real>
Trainer<Real> make_trainer(const TrainOptions& o, const Checkpoint* ck) {
  if (!ck) return Trainer<Real>(o);
  return Trainer<Real>(o, load_state<Real>(*ck), ck->position.micro_total);
}

}  // namespace

template <class Real>
Session<Real>::Session(const TrainOptions& options, const Checkpoint* ck)
    : data_(load_data(options)),
      vocab_(ck ? ck->vocab : Vocab::build(data_.train)),
      trainer_(make_trainer<Real>(with_data(options, vocab_), ck)),
      pos_(ck ? ck->position : Position{}),
      metrics_((std::filesystem::path(options.out_dir) / "metrics.csv").string()) {
  options_ = trainer_.options();
  // A checkpoint from other data may stand past this data's epoch: refused before anything is
  // written.
  const index_t micro_per_epoch =
      (static_cast<index_t>(data_.train.size()) + options_.batch_size - 1) / options_.batch_size;
  if (pos_.micro > micro_per_epoch) {
    throw FormatError("the checkpoint stands at micro-batch " + std::to_string(pos_.micro) +
                      " of its epoch, but this data has " + std::to_string(micro_per_epoch) +
                      " per epoch");
  }
  start_ = window_start_ = now_seconds();
  std::filesystem::create_directories(options_.out_dir);
  if (ck) metrics_.load(pos_.step);
  if (!options_.trace.empty()) trace_.emplace(options_, trainer_.params());
  const TrainOptions& o = options_;
  micro_per_epoch_ = (static_cast<index_t>(data_.train.size()) + o.batch_size - 1) / o.batch_size;
  steps_per_epoch_ = (micro_per_epoch_ + o.accum_steps - 1) / o.accum_steps;
  total_steps_ = steps_per_epoch_ * o.epochs;
  if (o.max_steps > 0) total_steps_ = std::min(total_steps_, o.max_steps);
  first_step_ = pos_.step;
  valid_ = for_model(
      batches_in_order(vocab_, data_.valid, o.eval_batch, o.model.embeddings.max_len), o.model);
}

template <class Real>
bool Session<Real>::done() const {
  return pos_.epoch >= options_.epochs || pos_.step >= total_steps_;
}

template <class Real>
bool Session<Real>::epoch_done() const {
  return pos_.micro >= micro_per_epoch_;
}

template <class Real>
StepReport Session<Real>::step() {
  const TrainOptions& o = options_;
  if (order_epoch_ != pos_.epoch) {
    order_ = epoch_batches(data_.train, o.batch_size, o.seed, pos_.epoch);
    order_epoch_ = pos_.epoch;
  }
  const index_t n_micro = std::min(o.accum_steps, micro_per_epoch_ - pos_.micro);
  std::vector<Batch> micro;
  for (index_t m = 0; m < n_micro; ++m) {
    std::vector<const Example*> ex;
    for (std::size_t i : order_[static_cast<std::size_t>(pos_.micro + m)])
      ex.push_back(&data_.train[i]);
    micro.push_back(for_model(make_batch(vocab_, ex, o.model.embeddings.max_len), o.model));
  }
  if (trace_) trace_->add_batches(pos_.step + 1, micro);
  const StepStats s = trainer_.step(micro);
  pos_ = {pos_.epoch, pos_.micro + n_micro, trainer_.steps(), trainer_.micro_batches_run()};
  if (trace_) trace_->add_stats(pos_.step, s);
  window_loss_ += s.loss;
  window_tokens_ += s.tokens;
  window_correct_ += s.correct;
  window_words_ += s.predictions;
  ++window_steps_;
  StepReport r{s, {}};
  const index_t log_every = std::max<index_t>(1, steps_per_epoch_ / 20);
  if (pos_.step % log_every == 0 || epoch_done() || done()) {
    const double now = now_seconds();
    Progress& p = r.progress;
    p.logged = true;
    p.loss = window_loss_ / static_cast<double>(window_steps_);
    p.accuracy = static_cast<double>(window_correct_) /
                 static_cast<double>(std::max<index_t>(window_words_, 1));
    p.tokens_per_s = static_cast<double>(window_tokens_) / std::max(now - window_start_, 1e-9);
    p.eta_seconds = (now - start_) / static_cast<double>(pos_.step - first_step_) *
                    static_cast<double>(total_steps_ - pos_.step);
    metrics_.add("train", pos_.epoch + 1, pos_.step, p.loss, p.accuracy, s.lr, p.tokens_per_s);
    window_loss_ = 0;
    window_tokens_ = window_correct_ = window_words_ = window_steps_ = 0;
    window_start_ = now;
  }
  return r;
}

template <class Real>
std::string Session<Real>::path_in_out_dir(const std::string& file) const {
  return (std::filesystem::path(options_.out_dir) / file).string();
}

template <class Real>
std::pair<Evaluation, std::string> Session<Real>::end_epoch() {
  const Evaluation v = trainer_.evaluate(valid_);
  metrics_.add("valid", pos_.epoch + 1, pos_.step, v.loss, v.accuracy,
               learning_rate(options_.optim, pos_.step), 0);
  pos_.epoch += 1;
  pos_.micro = 0;
  const std::string saved_at =
      path_in_out_dir("checkpoint-epoch" + std::to_string(pos_.epoch) + ".safetensors");
  save_checkpoint(saved_at, options_, vocab_, trainer_.state(), pos_);
  save_latest();
  return {v, saved_at};
}

template <class Real>
std::string Session<Real>::save_latest() {
  std::string latest = path_in_out_dir("checkpoint.safetensors");
  save_checkpoint(latest, options_, vocab_, trainer_.state(), pos_);
  return latest;
}

template <class Real>
Summary Session<Real>::finish() {
  const TrainOptions& o = options_;
  if (trace_) trace_->write(o.trace, trainer_.params(), pos_.step - first_step_);
  Summary s;
  s.test = trainer_.evaluate(for_model(
      batches_in_order(vocab_, data_.test, o.eval_batch, o.model.embeddings.max_len), o.model));
  nlohmann::json summary;
  if (o.model.decoder()) {
    TrigramLM tri;
    tri.fit(vocab_, data_.train, data_.valid, o.model.embeddings.max_len);
    s.test_perplexity = std::exp(s.test.loss);
    s.trigram_perplexity = tri.perplexity(data_.test);
    summary = {{"test_perplexity", s.test_perplexity},
               {"trigram_test_perplexity", s.trigram_perplexity},
               {"trigram_weights", tri.weights()},
               {"test_next_token_accuracy", s.test.accuracy},
               {"test_nll", s.test.loss},
               {"test_tokens", s.test.predictions}};
  } else {
    NaiveBayes nb;
    nb.fit(data_.train, static_cast<int>(languages().size()));
    s.naive_bayes_accuracy = nb.accuracy(data_.test);
    summary = {{"test_accuracy", s.test.accuracy},
               {"naive_bayes_test_accuracy", s.naive_bayes_accuracy},
               {"test_loss", s.test.loss},
               {"confusion", s.test.confusion}};
  }
  s.seconds = now_seconds() - start_;
  summary.update(nlohmann::json{{"steps", pos_.step},
                                {"epochs_completed", pos_.epoch},
                                {"seconds", s.seconds},
                                {"languages", languages_json()}});
  write_file_atomic(path_in_out_dir("summary.json"), summary.dump(2) + "\n", true);
  return s;
}

namespace {

volatile sig_atomic_t g_stop = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
  g_stop = sig;
}

}  // namespace

struct StopSignals::Saved {
  struct sigaction sigint {};
  struct sigaction sigterm {};
};

StopSignals::StopSignals() : saved_(std::make_unique<Saved>()) {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  g_stop = 0;
  sigaction(SIGINT, &sa, &saved_->sigint);
  sigaction(SIGTERM, &sa, &saved_->sigterm);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &saved_->sigint, nullptr);
  sigaction(SIGTERM, &saved_->sigterm, nullptr);
}

bool StopSignals::requested() {
  return g_stop != 0;
}

template class Session<float>;
template class Session<double>;

}  // namespace teo::train
