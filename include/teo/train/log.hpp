// What a training run records: metrics.csv (one row per logged step and per validation) and the
// trace (every step's batches, loss, learning rate and gradient norm, for replaying the run
// elsewhere, as tests/interop/train_exactness.py does in PyTorch).
#pragma once

#include <string>
#include <vector>

#include "teo/safetensors.hpp"
#include "teo/train/trainer.hpp"

namespace teo::train {

// metrics.csv: split,epoch,step,loss,accuracy,lr,tokens_per_s. Every add() rewrites the file
// whole, atomically.
class MetricsLog {
 public:
  explicit MetricsLog(std::string path) : path_(std::move(path)) {}
  // Keeps the rows of an existing file up to and including optimizer step `up_to_step`: a run
  // resumed from a checkpoint at that step appends to them, and the rows an interrupted run wrote
  // after it are dropped, so no step appears twice.
  void load(index_t up_to_step);
  void add(const std::string& split, index_t epoch, index_t step, double loss, double accuracy,
           double lr, double tokens_per_s);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::string> rows_;
};

// The trace file (format teo-train-trace/1): init.* and final.* parameters, and per optimizer
// step n (1-based) step.n.m.{tokens,lengths,labels} for its micro-batches m and
// step.n.{loss,lr,grad_norm}.
class Trace {
 public:
  template <class Real>
  Trace(const TrainOptions& o, const Params<Real>& init);
  void add_batches(index_t step, const std::vector<Batch>& micro_batches);
  void add_stats(index_t step, const StepStats& stats);
  // Adds final.* and writes the file; once, at the end of the run.
  template <class Real>
  void write(const std::string& path, const Params<Real>& final, index_t steps);

 private:
  safetensors::File file_;
};

}  // namespace teo::train
