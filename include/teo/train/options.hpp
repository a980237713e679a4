// TrainOptions: every setting of a training run, and the one place that states its default.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/config.hpp"
#include "teo/train/data.hpp"
#include "teo/train/optim.hpp"

namespace teo::train {

struct TrainOptions {
  // The demo's model. vocab_size and num_classes are decided by the data.
  ModelConfig model{.d_model = 64,
                    .num_layers = 2,
                    .dropout = 0.0,  // docs/training.md, "Why these defaults"
                    .embeddings = {.max_len = 32},
                    .attention = {.num_heads = 8},
                    .ffn = {.d_ff = 256, .activation = Activation::relu},
                    .norms = {.norm_first = true},
                    .head = {.pooling = Pooling::mean, .label_smoothing = 0.1}};
  OptimOptions optim;  // lr 4e-3, 300 warmup steps, weight decay 0.1, clip norm 1
  DataOptions data;    // 40000 words per language from /usr/share/dict
  index_t epochs = 6;
  index_t max_steps = 0;  // stop after this many optimizer steps (0: run every epoch)
  index_t batch_size = 64;
  index_t accum_steps = 1;
  // Each micro-batch is cut into this many contiguous parts of near-equal size. Their passes run
  // in parallel, and their gradients are summed in part order, weighted by part size, so the
  // result depends on `shards` but never on the thread count.
  index_t shards = 2;
  index_t eval_batch = 512;
  // Decay of the exponential moving average of the weights (ema_update) that validation, the test
  // and prediction use; 0 evaluates the last weights instead.
  double ema = 0.999;
  std::uint64_t seed = 0;
  std::string dtype = "float32";
  std::string out_dir = "train-out";
  std::string resume;  // a checkpoint to continue from
  std::string trace;   // write every step's batches, loss, lr and grad norm here
  nlohmann::json given = nlohmann::json::object();  // the keys the user set (file and flags)
  bool progress = true;
  bool plot = true;

  // Applies every key of `j` (model keys as in ModelConfig, except vocab_size and num_classes,
  // which the data decides; training keys as in to_json()). ConfigError on unknown keys, wrong
  // types and out-of-range values.
  void apply_json(const nlohmann::json& j);
  // The JSON object in `path`, as the keys the user gave: FileError when it cannot be read,
  // ConfigError naming the path when it is not a JSON object. (apply_json applies it.)
  static nlohmann::json read_keys(const std::string& path);
  nlohmann::json to_json() const;   // the training keys
  nlohmann::json all_keys() const;  // the model keys and the training keys, as one object
  void validate() const;
};

// The keys a training config accepts (and `teo train` as --key-with-dashes flags), each with its
// JSON type ("int", "real", "bool", "string") and help text.
struct TrainKey {
  const char* key;
  const char* type;
  const char* help;
};
const std::vector<TrainKey>& train_keys();
// The key's flag, "--max-steps" for max_steps.
std::string flag_name(const TrainKey& key);
// Its help with its type and its default in `defaults`: "peak learning rate [real, default 0.004]".
std::string help_text(const TrainKey& key, const TrainOptions& defaults = {});
// A flag's text as the JSON value of its key's type; ConfigError naming the flag otherwise.
nlohmann::json parse_flag_value(const TrainKey& key, const std::string& text);

}  // namespace teo::train
