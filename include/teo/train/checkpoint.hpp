// Checkpoints: one safetensors file holding the parameters, the AdamW moments, the averaged
// weights, the vocabulary, the settings and where the data loop stands, written atomically.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

#include "teo/safetensors.hpp"
#include "teo/train/options.hpp"

namespace teo::train {

inline constexpr const char* kCheckpointFormat = "teo-checkpoint/1";

// Where a run stands.
struct Position {
  index_t epoch = 0;        // the epoch in progress (0-based)
  index_t micro = 0;        // the next micro-batch of that epoch
  index_t step = 0;         // optimizer steps taken
  index_t micro_total = 0;  // micro-batches run, over all epochs (the dropout counter)
};

// What a run changes as it trains. `ema` is empty when the run keeps no averaged weights.
template <class Real>
struct TrainState {
  Params<Real> params;
  AdamW<Real> adam;
  Params<Real> ema;
};

// A checkpoint read and checked: its settings, vocabulary and position, and its tensors.
struct Checkpoint {
  std::string path;
  safetensors::File file;
  TrainOptions options;  // the saved settings, model config included
  Vocab vocab;
  Position position;
};

// Reads `path`: FileError when it cannot be read, FormatError naming what is wrong when it is not
// a teo checkpoint or its metadata is malformed.
Checkpoint read_checkpoint(const std::string& path);

// The options of a resumed run: the checkpoint's, with where to write (out_dir, trace, progress,
// plot) from `requested`. Of the keys in `requested.given`, epochs, max_steps and eval_batch
// override the checkpoint's; any other key must have the checkpoint's value (ConfigError naming
// the key and both values otherwise), so the same --config file may be given again.
TrainOptions resume_options(const Checkpoint& ck, const TrainOptions& requested);

// The saved state, in the checkpoint's dtype (FormatError when a tensor is missing or does not
// fit the config); adam.step is the position's step.
template <class Real>
TrainState<Real> load_state(const Checkpoint& ck);

// The parameters of `prefix` ("param." or "ema.") in `f`; FormatError naming `path` and the tensor
// when one is missing or has the wrong dtype or shape for `cfg`.
template <class Real>
Params<Real> load_params(const safetensors::File& f, const std::string& prefix,
                         const ModelConfig& cfg, const std::string& path);

template <class Real>
void save_checkpoint(const std::string& path, const TrainOptions& o, const Vocab& vocab,
                     const TrainState<Real>& state, const Position& pos);

// Appends every parameter of `p` to `f`, named prefix + its contract name.
template <class Real>
void add_params(safetensors::File& f, const std::string& prefix, const Params<Real>& p);

// The language codes in label order, as a JSON array.
nlohmann::json languages_json();

}  // namespace teo::train
