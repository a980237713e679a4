// `teo train` and `teo predict`: the CPU training demo.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/config.hpp"
#include "teo/train.hpp"

namespace teo::cli {

struct TrainOptions {
  EncoderConfig model;  // vocab_size and num_classes come from the data
  train::OptimOptions optim;
  train::DataOptions data;
  index_t epochs = 3;
  index_t max_steps = 0;  // stop after this many optimizer steps (0: run every epoch)
  index_t batch_size = 64;
  index_t accum_steps = 1;
  // Each micro-batch is cut into this many contiguous parts of near-equal size. Their passes run
  // in parallel, and their gradients are summed in part order, weighted by part size, so the
  // result depends on `shards` but never on the thread count.
  index_t shards = 2;
  index_t eval_batch = 512;
  // Decay of the exponential moving average of the weights (train::ema_update) that validation,
  // the test and `teo predict` use; 0 evaluates the last weights instead.
  double ema = 0.999;
  std::uint64_t seed = 0;
  std::string dtype = "float32";
  std::string out_dir = "train-out";
  std::string resume;  // a checkpoint to continue from
  std::string trace;   // write every step's batches, loss, lr and grad norm here
  nlohmann::json given = nlohmann::json::object();  // the keys the user set (file and flags)
  bool progress = true;
  bool plot = true;

  // The demo's defaults: 40000 words per language; d_model 64, 8 heads, d_ff 256, 2 pre-norm
  // layers, relu, mean pooling, no dropout, label smoothing 0.1, max_len 32; 6 epochs, lr 4e-3
  // with 300 warmup steps, weight decay 0.1, averaged weights (ema 0.999), shards 2.
  static TrainOptions defaults();
  // Applies every key of `j` (model keys as in EncoderConfig, except vocab_size and num_classes,
  // which the data decides; training keys as in to_json()). ConfigError on unknown keys, wrong
  // types and out-of-range values.
  void apply_json(const nlohmann::json& j);
  nlohmann::json to_json() const;  // the training keys
  void validate() const;
};

// The keys `teo train` accepts as flags (--key-with-dashes VALUE) and in --config files, each with
// its JSON type ("int", "real", "bool", "string") and help text.
struct TrainKey {
  const char* key;
  const char* type;
  const char* help;
};
const std::vector<TrainKey>& train_keys();
// A flag's text as the JSON value of its key's type; ConfigError naming the flag otherwise.
nlohmann::json parse_flag_value(const TrainKey& key, const std::string& text);

// Returns the exit code; teo::Error propagates (exit 2).
int run_train(const TrainOptions& opts, std::ostream& out);
int run_predict(const std::string& checkpoint, const std::vector<std::string>& words,
                std::ostream& out);

}  // namespace teo::cli
