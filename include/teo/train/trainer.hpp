// Trainer<Real>: one optimizer step over a list of micro-batches (forward, backward, gradient
// accumulation, clipping, AdamW, the weight average), evaluation and prediction.
//
//   Trainer<float> trainer(options);                  // parameters from options.seed
//   for (...) {
//     StepStats s = trainer.step(micro_batches);      // forward, zero_grad, backward, update
//   }
//   Evaluation e = trainer.evaluate(valid_batches);   // loss, accuracy, confusion matrix
//   Tensor<float> p = trainer.predict(batch);         // class probabilities (B, C)
#pragma once

#include <vector>

#include "teo/train/checkpoint.hpp"
#include "teo/train/options.hpp"

namespace teo::train {

struct StepStats {
  double loss = 0;          // the mean loss over the step's micro-batches
  double grad_norm = 0;     // before clipping
  double lr = 0;            // the learning rate the step used
  index_t correct = 0;      // predictions that were right (largest logit; training mode)
  index_t predictions = 0;  // words (an encoder), or next tokens with a target (a decoder)
  index_t words = 0;
  index_t tokens = 0;  // real tokens, padding excluded
};

// An encoder's: the loss and accuracy over words, and the confusion matrix. A decoder's: the mean
// negative log-likelihood per predicted token (without label smoothing: log(perplexity)) and the
// next-token accuracy; no confusion matrix.
struct Evaluation {
  double loss = 0, accuracy = 0;
  std::vector<std::vector<index_t>> confusion;  // [true][predicted]
  index_t predictions = 0;                      // words, or next tokens
};

template <class Real>
class Trainer {
 public:
  // A new run: parameters from options.seed. The options must be complete (vocab_size and
  // num_classes set) and valid; ConfigError otherwise.
  explicit Trainer(const TrainOptions& options);
  // A run that continues from a saved state, `micro_batches_run` micro-batches in.
  Trainer(const TrainOptions& options, TrainState<Real> state, index_t micro_batches_run);

  // One optimizer step: each micro-batch is cut into options.shards parts whose forward and
  // backward passes run in parallel; every part's gradient is weighted by its share of the words
  // and summed in a fixed order, the micro-batches' gradients are averaged, clipped to
  // options.optim.clip_norm, and AdamW updates the parameters (and the averaged weights). Dropout
  // draws follow from (seed, micro-batch counter, part), so the bits depend on neither the thread
  // count nor how the run was interrupted and resumed. InputError on an empty list or batch;
  // TrainingDiverged when the loss is not finite.
  StepStats step(const std::vector<Batch>& micro_batches);

  // Loss, accuracy and confusion matrix of the evaluated weights (the averaged ones when the run
  // keeps them) over `batches`, in eval mode; batches run in parallel, results sum in order.
  Evaluation evaluate(const std::vector<Batch>& batches) const;

  // The evaluated weights' class probabilities (B, C) for `batch` (labels are not used).
  Tensor<Real> predict(const Batch& batch) const;

  const TrainOptions& options() const { return options_; }
  const TrainState<Real>& state() const { return state_; }
  const Params<Real>& params() const { return state_.params; }
  // The averaged weights when options.ema > 0, else the parameters.
  const Params<Real>& evaluated() const { return options_.ema > 0 ? state_.ema : state_.params; }
  index_t steps() const { return state_.adam.step; }
  index_t micro_batches_run() const { return micro_total_; }

 private:
  struct Shard {
    Batch batch;
    Activations<Real> acts, dacts;
    Params<Real> grads;
    index_t correct = 0, predictions = 0;
  };
  TrainOptions options_;
  TrainState<Real> state_;
  index_t micro_total_ = 0;
  Params<Real> grads_;
  std::vector<Shard> shards_;
};

// The predictions of a checkpoint's evaluated weights (the averaged ones when it keeps them):
// class probabilities (B, C), in double whatever the checkpoint's dtype.
std::vector<std::vector<double>> predict_from_checkpoint(const Checkpoint& ck, const Batch& batch);

extern template class Trainer<float>;
extern template class Trainer<double>;

}  // namespace teo::train
