#include "teo/train/trainer.hpp"

#include <algorithm>
#include <cmath>

#include "teo/backend.hpp"
#include "teo/rng.hpp"

namespace teo::train {

namespace {

// Rows [first, last) of `b`, padded to their own longest sequence: the batch make_batch gives for
// those examples alone.
Batch slice_rows(const Batch& b, index_t first, index_t last) {
  Batch part;
  part.batch = last - first;
  part.seq_len = 1;
  for (index_t i = first; i < last; ++i) {
    part.seq_len = std::max<index_t>(part.seq_len, b.lengths[static_cast<std::size_t>(i)]);
  }
  part.seq_len = std::min(part.seq_len, b.seq_len);
  for (index_t i = first; i < last; ++i) {
    const auto row = b.tokens.begin() + static_cast<std::ptrdiff_t>(i * b.seq_len);
    part.tokens.insert(part.tokens.end(), row, row + static_cast<std::ptrdiff_t>(part.seq_len));
    part.lengths.push_back(b.lengths[static_cast<std::size_t>(i)]);
    if (!b.labels.empty()) part.labels.push_back(b.labels[static_cast<std::size_t>(i)]);
  }
  return part;
}

// A decoder's predictions on `batch`: for every position with a next token, whether the largest
// logit is that token, and -log p of it (in double, from the logits); added into the three sums.
template <class Real>
void score_next_tokens(const Activations<Real>& acts, const Batch& batch, index_t V,
                       index_t& correct, index_t& predictions, double* nll) {
  const index_t S = batch.seq_len;
  for (index_t b = 0; b < batch.batch; ++b) {
    for (index_t t = 0; t + 1 < batch.lengths[static_cast<std::size_t>(b)]; ++t) {
      const Real* z = acts.lm_logits.data() + (b * S + t) * V;
      const auto y = batch.tokens[static_cast<std::size_t>(b * S + t + 1)];
      index_t best = 0;
      for (index_t c = 1; c < V; ++c) best = z[c] > z[best] ? c : best;
      correct += best == y;
      ++predictions;
      if (nll) {
        double sum = 0;
        const double top = static_cast<double>(z[best]);
        for (index_t c = 0; c < V; ++c) sum += std::exp(static_cast<double>(z[c]) - top);
        *nll += std::log(sum) - (static_cast<double>(z[y]) - top);
      }
    }
  }
}

// The class with the largest logit in row i (the first one on ties).
template <class Real>
index_t predicted_class(const Tensor<Real>& logits, index_t i, index_t C) {
  index_t best = 0;
  for (index_t c = 1; c < C; ++c) {
    if (logits[i * C + c] > logits[i * C + best]) best = c;
  }
  return best;
}

template <class Real>
void axpy_params(Params<Real>& acc, const Params<Real>& g, Real scale) {
  for_each_pair(acc, g, "gradient accumulation", [&](Tensor<Real>& t, const Tensor<Real>& s) {
    for (index_t i = 0; i < t.numel(); ++i) t[i] += s[i] * scale;
  });
}

template <class Real>
void check_batch(const ModelConfig& cfg, const Batch& b) {
  if (b.batch < 1) throw InputError("a training batch must hold at least one sequence");
  validate_batch(cfg, b, sizeof(Real));
}

}  // namespace

template <class Real>
Trainer<Real>::Trainer(const TrainOptions& options) : options_(options) {
  options_.validate();
  state_.params = Params<Real>::init(options_.model, options_.seed);
  state_.adam = AdamW<Real>::zeros(options_.model);
  if (options_.ema > 0) state_.ema = state_.params;
  grads_ = Params<Real>::zeros(options_.model);
  shards_.resize(static_cast<std::size_t>(options_.shards));
}

template <class Real>
Trainer<Real>::Trainer(const TrainOptions& options, TrainState<Real> state,
                       index_t micro_batches_run)
    : options_(options), state_(std::move(state)), micro_total_(micro_batches_run) {
  options_.validate();
  if (!(state_.params.config == options_.model)) {
    throw ConfigError("the saved state's model config differs from the options' model config");
  }
  if (options_.ema > 0 && state_.ema.count() != state_.params.count()) {
    throw ConfigError("ema > 0 needs the saved averaged weights");
  }
  if (micro_batches_run < 0) throw ConfigError("micro_batches_run must be >= 0");
  grads_ = Params<Real>::zeros(options_.model);
  shards_.resize(static_cast<std::size_t>(options_.shards));
}

template <class Real>
StepStats Trainer<Real>::step(const std::vector<Batch>& micro_batches) {
  if (micro_batches.empty()) throw InputError("a training step needs at least one micro-batch");
  for (const Batch& b : micro_batches) check_batch<Real>(options_.model, b);
  const TrainOptions& o = options_;
  const index_t C = o.model.head.num_classes;
  const index_t n_micro = static_cast<index_t>(micro_batches.size());
  const auto dropout_stream = rng::stream_id("train.dropout");
  StepStats stats;
  grads_.visit([](const std::string&, Tensor<Real>& t) { t.zero(); });
  for (index_t m = 0; m < n_micro; ++m) {
    const Batch& mb = micro_batches[static_cast<std::size_t>(m)];
    const index_t n = mb.batch;
    const index_t n_shards = std::min(o.shards, n);
    const auto micro_id = static_cast<std::uint64_t>(micro_total_ + m);
    parallel_tasks(n_shards, [&](std::int64_t s) {
      Shard& sh = shards_[static_cast<std::size_t>(s)];
      sh.batch = slice_rows(mb, n * s / n_shards, n * (s + 1) / n_shards);
      const std::uint64_t dseed = rng::bits(
          o.seed, dropout_stream,
          micro_id * static_cast<std::uint64_t>(o.shards) + static_cast<std::uint64_t>(s));
      forward(state_.params, sh.batch, sh.acts, {.train = true, .dropout_seed = dseed});
      backward(state_.params, sh.batch, sh.acts, sh.grads, sh.dacts);
      sh.correct = sh.predictions = 0;
      if (o.model.decoder()) {
        score_next_tokens(sh.acts, sh.batch, o.model.embeddings.vocab_size, sh.correct,
                          sh.predictions, nullptr);
        return;
      }
      for (index_t i = 0; i < sh.batch.batch; ++i) {
        sh.correct +=
            predicted_class(sh.acts.logits, i, C) == sh.batch.labels[static_cast<std::size_t>(i)];
      }
      sh.predictions = sh.batch.batch;
    });
    // Each part's loss and gradient are means over its words (a decoder's: over its next tokens):
    // weight them by its share.
    index_t micro_predictions = 0;
    for (index_t s = 0; s < n_shards; ++s)
      micro_predictions += shards_[static_cast<std::size_t>(s)].predictions;
    for (index_t s = 0; s < n_shards; ++s) {
      const Shard& sh = shards_[static_cast<std::size_t>(s)];
      const double share = micro_predictions == 0 ? 0.0
                                                  : static_cast<double>(sh.predictions) /
                                                        static_cast<double>(micro_predictions);
      axpy_params(grads_, sh.grads, static_cast<Real>(share / static_cast<double>(n_micro)));
      stats.loss += share * static_cast<double>(sh.acts.loss[0]);
      stats.correct += sh.correct;
      stats.predictions += sh.predictions;
      stats.words += sh.batch.batch;
      for (auto len : sh.batch.lengths) stats.tokens += len;
    }
  }
  stats.loss /= static_cast<double>(n_micro);
  stats.grad_norm = global_norm(grads_);
  clip_by_norm(grads_, stats.grad_norm, o.optim.clip_norm);
  stats.lr = learning_rate(o.optim, state_.adam.step + 1);
  state_.adam.update(state_.params, grads_, o.optim, stats.lr);
  if (o.ema > 0) ema_update(state_.ema, state_.params, ema_decay(o.ema, state_.adam.step));
  micro_total_ += n_micro;
  if (!std::isfinite(stats.loss)) {
    throw TrainingDiverged("training diverged: the loss at step " +
                           std::to_string(state_.adam.step) + " is not finite (lower --lr)");
  }
  return stats;
}

template <class Real>
Evaluation Trainer<Real>::evaluate(const std::vector<Batch>& batches) const {
  const index_t C = options_.model.head.num_classes;
  const bool decoder = options_.model.decoder();
  Evaluation e;
  if (!decoder) {
    e.confusion.assign(static_cast<std::size_t>(C),
                       std::vector<index_t>(static_cast<std::size_t>(C), 0));
  }
  for (const Batch& b : batches) validate_batch(options_.model, b, sizeof(Real));
  struct Result {
    double loss_sum = 0;
    std::vector<index_t> predicted;
    index_t correct = 0, predictions = 0;  // a decoder's next tokens
  };
  const std::size_t n_batches = batches.size();
  std::vector<Result> results(n_batches);
  const std::int64_t workers =
      std::min<std::int64_t>(num_threads(), static_cast<std::int64_t>(n_batches));
  const Params<Real>& weights = evaluated();
  parallel_tasks(workers, [&](std::int64_t w) {
    Activations<Real> acts;
    for (std::size_t k = static_cast<std::size_t>(w); k < n_batches;
         k += static_cast<std::size_t>(workers)) {
      const Batch& b = batches[k];
      forward(weights, b, acts, {.train = false, .dropout_seed = 0});
      if (decoder) {
        score_next_tokens(acts, b, options_.model.embeddings.vocab_size, results[k].correct,
                          results[k].predictions, &results[k].loss_sum);
        continue;
      }
      results[k].loss_sum = static_cast<double>(acts.loss[0]) * static_cast<double>(b.batch);
      for (index_t i = 0; i < b.batch; ++i)
        results[k].predicted.push_back(predicted_class(acts.logits, i, C));
    }
  });
  double loss_sum = 0;
  index_t correct = 0, total = 0;
  for (std::size_t k = 0; k < n_batches; ++k) {
    loss_sum += results[k].loss_sum;
    correct += results[k].correct;
    total += results[k].predictions;
    for (std::size_t i = 0; i < results[k].predicted.size(); ++i) {
      const auto y = static_cast<std::size_t>(batches[k].labels[i]);
      const auto best = static_cast<std::size_t>(results[k].predicted[i]);
      correct += best == y;
      ++e.confusion[y][best];
      ++total;
    }
  }
  e.predictions = total;
  if (total > 0) {
    e.loss = loss_sum / static_cast<double>(total);
    e.accuracy = static_cast<double>(correct) / static_cast<double>(total);
  }
  return e;
}

namespace {

// The class probabilities (B, C) of `weights` on `batch` in eval mode; its labels are not used.
template <class Real>
Tensor<Real> class_probabilities(const Params<Real>& weights, const Batch& batch) {
  Batch b = batch;
  b.labels.assign(static_cast<std::size_t>(b.batch), 0);
  Activations<Real> acts;
  forward(weights, b, acts, {.train = false, .dropout_seed = 0});
  return std::move(acts.class_probs);
}

}  // namespace

template <class Real>
Tensor<Real> Trainer<Real>::predict(const Batch& batch) const {
  if (options_.model.decoder()) {
    throw ConfigError("predict classifies words: this trainer's model is a language model");
  }
  return class_probabilities(evaluated(), batch);
}

std::vector<std::vector<double>> predict_from_checkpoint(const Checkpoint& ck, const Batch& batch) {
  if (ck.options.model.decoder()) {
    throw ConfigError(ck.path +
                      ": the checkpoint is a language model (architecture \"decoder\"); "
                      "predict classifies words with an encoder's checkpoint");
  }
  auto run = [&](auto zero) {
    using Real = decltype(zero);
    const bool averaged = std::any_of(ck.file.tensors.begin(), ck.file.tensors.end(),
                                      [](const auto& t) { return t.name.rfind("ema.", 0) == 0; });
    const Tensor<Real> probs = class_probabilities(
        load_params<Real>(ck.file, averaged ? "ema." : "param.", ck.options.model, ck.path), batch);
    const index_t C = ck.options.model.head.num_classes;
    std::vector<std::vector<double>> p(static_cast<std::size_t>(batch.batch));
    for (index_t i = 0; i < batch.batch; ++i) {
      for (index_t c = 0; c < C; ++c)
        p[static_cast<std::size_t>(i)].push_back(static_cast<double>(probs[i * C + c]));
    }
    return p;
  };
  return ck.options.dtype == "float64" ? run(0.0) : run(0.0f);
}

template class Trainer<float>;
template class Trainer<double>;

}  // namespace teo::train
