// `teo train` and `teo predict`: the CPU training demo's command-line face over teo::train.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "teo/train/options.hpp"

namespace teo::cli {

// Trains (or resumes opts.resume) with progress lines, metrics.csv, checkpoints, summary.json
// and curves.png in opts.out_dir. Returns the exit code; teo::Error propagates (exit 2).
int run_train(const train::TrainOptions& opts, std::ostream& out);
// Prints each word's language and class probabilities from a checkpoint's evaluated weights.
int run_predict(const std::string& checkpoint, const std::vector<std::string>& words,
                std::ostream& out);

}  // namespace teo::cli
