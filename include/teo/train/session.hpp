// Session<Real>: the training demo's whole run as a library object. It loads the word lists,
// builds (or restores) the vocabulary and the Trainer, walks the epochs' micro-batches, writes
// the checkpoints, metrics.csv, the trace and summary.json, and leaves the printing to its
// caller. `teo train` is this loop:
//
//   Session<float> s(options, checkpoint);     // checkpoint: nullptr for a new run
//   while (!s.done()) {
//     StepStats st = s.step();                // the next accum_steps micro-batches
//     if (s.epoch_done()) s.end_epoch();      // validation and the epoch's checkpoints
//   }
//   s.finish();                               // the test, the yardstick, summary.json
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "teo/train/checkpoint.hpp"
#include "teo/train/data.hpp"
#include "teo/train/log.hpp"
#include "teo/train/trainer.hpp"

namespace teo::train {

// The running figures since the previous metrics.csv row. A row is written every
// max(1, steps_per_epoch / 20) steps, at the end of each epoch and at the last step.
struct Progress {
  bool logged = false;  // this step wrote a row; the fields are that row's
  double loss = 0, accuracy = 0, tokens_per_s = 0;
  double eta_seconds = 0;  // at the session's pace so far
};

struct StepReport {
  StepStats stats;
  Progress progress;
};

struct Summary {
  Evaluation test;
  double naive_bayes_accuracy = 0;  // an encoder's yardstick: character-trigram naive Bayes
  // a decoder's: its test perplexity, and the character-trigram model's (TrigramLM) on the same
  // test split
  double test_perplexity = 0, trigram_perplexity = 0;
  double seconds = 0;  // since the session started
};

template <class Real>
class Session {
 public:
  // A new run, or one that continues `ck` (whose options must be resume_options(ck, ...)).
  // Creates options.out_dir and checks that it and the trace's directory are writable before it
  // reads the data (FileError naming the path). The errors of load_words, Trainer and the
  // checkpoint functions.
  Session(const TrainOptions& options, const Checkpoint* ck);

  bool done() const;        // every epoch finished, or max_steps reached
  bool epoch_done() const;  // the epoch in progress has used all its micro-batches
  // One optimizer step on the next micro-batches (at most accum_steps, fewer at an epoch's end),
  // with the trace recorded when options.trace is set and the metrics row when one is due.
  StepReport step();
  // Validates the finished epoch, logs it, moves to the next and writes checkpoint-epochN and
  // checkpoint.safetensors; returns the validation and the epoch checkpoint's path.
  std::pair<Evaluation, std::string> end_epoch();
  // Writes checkpoint.safetensors at the current position (a run stopped by max_steps).
  std::string save_latest();
  // The test set and the yardstick, then summary.json and the trace file.
  Summary finish();

  const TrainOptions& options() const { return options_; }
  const Dataset& data() const { return data_; }
  const Trainer<Real>& trainer() const { return trainer_; }
  const Position& position() const { return pos_; }
  MetricsLog& metrics() { return metrics_; }
  index_t steps_per_epoch() const { return steps_per_epoch_; }
  index_t total_steps() const { return total_steps_; }  // of the whole run, max_steps applied
  index_t first_step() const { return first_step_; }    // the step the session started at

 private:
  std::string path_in_out_dir(const std::string& file) const;

  TrainOptions options_;
  Dataset data_;
  Vocab vocab_;
  Trainer<Real> trainer_;
  Position pos_;
  MetricsLog metrics_;
  std::optional<Trace> trace_;
  std::vector<Batch> valid_;
  std::vector<std::vector<std::size_t>> order_;  // the micro-batches of order_epoch_
  index_t order_epoch_ = -1;
  index_t micro_per_epoch_ = 0, steps_per_epoch_ = 0, total_steps_ = 0, first_step_ = 0;
  double start_ = 0;
  // The window since the previous metrics row.
  double window_loss_ = 0, window_start_ = 0;
  index_t window_tokens_ = 0, window_correct_ = 0, window_words_ = 0, window_steps_ = 0;
};

// While one lives, SIGINT and SIGTERM only set requested(), which a training loop checks between
// steps to keep a checkpoint and stop (`teo train` then exits 130); a second signal ends the
// process as the default action would. The previous handlers come back when it is destroyed.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  static bool requested();

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

extern template class Session<float>;
extern template class Session<double>;

}  // namespace teo::train
