#include "teo/cli/train.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "teo/backend.hpp"
#include "teo/rng.hpp"
#include "teo/safetensors.hpp"

namespace teo::cli {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;
namespace st = safetensors;
using Clock = std::chrono::steady_clock;

const char* kCheckpointFormat = "teo-checkpoint/1";

index_t get_int(const json& v, const std::string& key) {
  if (!v.is_number_integer()) throw ConfigError(key + " must be an integer, got " + v.dump());
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    throw ConfigError(key + " is too large: " + v.dump());
  }
  return v.get<index_t>();
}

double get_real(const json& v, const std::string& key) {
  if (!v.is_number()) throw ConfigError(key + " must be a number, got " + v.dump());
  const double d = v.get<double>();
  if (!std::isfinite(d)) throw ConfigError(key + " must be finite");
  return d;
}

std::string get_string(const json& v, const std::string& key) {
  if (!v.is_string()) throw ConfigError(key + " must be a string, got " + v.dump());
  return v.get<std::string>();
}

}  // namespace

const std::vector<TrainKey>& train_keys() {
  static const std::vector<TrainKey> keys = {
      {"max_len", "int", "longest input in tokens, [CLS] included; longer words are cut"},
      {"d_model", "int", "model width"},
      {"num_heads", "int", "attention heads"},
      {"d_ff", "int", "feed-forward width"},
      {"num_layers", "int", "encoder layers"},
      {"norm_first", "bool", "pre-norm (true) or post-norm (false)"},
      {"activation", "string", "relu | gelu | gelu_tanh"},
      {"layer_norm_eps", "real", "LayerNorm epsilon"},
      {"positional", "string", "sinusoidal | learned"},
      {"embed_scale", "bool", "scale token embeddings by sqrt(d_model)"},
      {"pooling", "string", "mean | cls | max"},
      {"dropout", "real", "dropout probability at every site"},
      {"label_smoothing", "real", "label smoothing of the cross-entropy"},
      {"causal", "bool", "causal attention mask"},
      {"dtype", "string", "float32 | float64"},
      {"epochs", "int", "passes over the training set"},
      {"max_steps", "int", "stop after this many optimizer steps (0: no limit)"},
      {"batch_size", "int", "words per micro-batch"},
      {"accum_steps", "int", "micro-batches accumulated per optimizer step"},
      {"shards", "int",
       "parts of each micro-batch computed in parallel and summed in a fixed order (the result "
       "does not depend on --threads)"},
      {"eval_batch", "int", "words per evaluation batch"},
      {"ema", "real",
       "decay of the averaged weights used for evaluation, checkpoints' predictions and the "
       "test (0: evaluate the last weights)"},
      {"lr", "real", "peak learning rate"},
      {"warmup_steps", "int", "linear warmup steps, then inverse-sqrt decay"},
      {"weight_decay", "real", "AdamW decoupled weight decay (matrices only)"},
      {"beta1", "real", "AdamW beta1"},
      {"beta2", "real", "AdamW beta2"},
      {"adam_eps", "real", "AdamW epsilon"},
      {"clip_norm", "real", "clip gradients to this global L2 norm (0: off)"},
      {"seed", "int", "initialisation, shuffling and dropout seed"},
      {"per_language", "int", "words kept per language (class balance)"},
      {"data_dir", "string", "directory holding the word lists"},
  };
  return keys;
}

json parse_flag_value(const TrainKey& key, const std::string& text) {
  std::string flag = std::string("--") + key.key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  const std::string type = key.type;
  try {
    std::size_t used = 0;
    if (type == "int") {
      const long long v = std::stoll(text, &used);
      if (used == text.size()) return v;
    } else if (type == "real") {
      const double v = std::stod(text, &used);
      if (used == text.size()) return v;
    } else if (type == "bool") {
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
    } else {
      return text;
    }
  } catch (const std::exception&) {
  }
  throw ConfigError(flag + " takes " +
                    (type == "int"    ? "an integer"
                     : type == "real" ? "a number"
                                      : "true or false") +
                    ", got \"" + text + "\"");
}

TrainOptions TrainOptions::defaults() {
  TrainOptions o;
  o.model.max_len = 32;
  o.model.d_model = 64;
  o.model.num_heads = 8;
  o.model.d_ff = 256;
  o.model.num_layers = 2;
  o.model.norm_first = true;
  o.model.activation = Activation::relu;
  o.model.pooling = Pooling::mean;
  o.model.dropout = 0.0;  // see docs/training.md, "Why these defaults"
  o.epochs = 6;
  o.data.per_language = 40000;
  o.optim.lr = 4e-3;
  o.optim.warmup_steps = 300;
  o.optim.weight_decay = 0.1;
  o.model.label_smoothing = 0.1;
  return o;
}

void TrainOptions::apply_json(const json& j) {
  if (!j.is_object()) throw ConfigError("a training config must be a JSON object");
  json mj = model.to_json();
  for (const auto& [key, v] : j.items()) {
    if (key == "vocab_size" || key == "num_classes") {
      throw ConfigError(key + " is decided by the data and cannot be set");
    } else if (key == "dtype") {
      dtype = get_string(v, key);
    } else if (key == "epochs") {
      epochs = get_int(v, key);
    } else if (key == "max_steps") {
      max_steps = get_int(v, key);
    } else if (key == "batch_size") {
      batch_size = get_int(v, key);
    } else if (key == "accum_steps") {
      accum_steps = get_int(v, key);
    } else if (key == "shards") {
      shards = get_int(v, key);
    } else if (key == "eval_batch") {
      eval_batch = get_int(v, key);
    } else if (key == "ema") {
      ema = get_real(v, key);
    } else if (key == "lr") {
      optim.lr = get_real(v, key);
    } else if (key == "warmup_steps") {
      optim.warmup_steps = get_int(v, key);
    } else if (key == "weight_decay") {
      optim.weight_decay = get_real(v, key);
    } else if (key == "beta1") {
      optim.beta1 = get_real(v, key);
    } else if (key == "beta2") {
      optim.beta2 = get_real(v, key);
    } else if (key == "adam_eps") {
      optim.adam_eps = get_real(v, key);
    } else if (key == "clip_norm") {
      optim.clip_norm = get_real(v, key);
    } else if (key == "seed") {
      // A flag's value arrives as a signed integer, a JSON file's as unsigned.
      const bool ok =
          v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0);
      if (!ok) throw ConfigError("seed must be a non-negative integer, got " + v.dump());
      seed = v.get<std::uint64_t>();
    } else if (key == "per_language") {
      data.per_language = get_int(v, key);
    } else if (key == "data_dir") {
      data.dir = get_string(v, key);
    } else {
      mj[key] = v;  // EncoderConfig rejects unknown keys and bad values
    }
  }
  model = EncoderConfig::from_json(mj);
}

json TrainOptions::to_json() const {
  return json{{"dtype", dtype},
              {"epochs", epochs},
              {"max_steps", max_steps},
              {"batch_size", batch_size},
              {"accum_steps", accum_steps},
              {"shards", shards},
              {"eval_batch", eval_batch},
              {"ema", ema},
              {"lr", optim.lr},
              {"warmup_steps", optim.warmup_steps},
              {"weight_decay", optim.weight_decay},
              {"beta1", optim.beta1},
              {"beta2", optim.beta2},
              {"adam_eps", optim.adam_eps},
              {"clip_norm", optim.clip_norm},
              {"seed", seed},
              {"per_language", data.per_language},
              {"data_dir", data.dir}};
}

void TrainOptions::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw ConfigError(what);
  };
  need(dtype == "float32" || dtype == "float64", "dtype must be float32 or float64, got " + dtype);
  need(epochs >= 1 && epochs <= 100000,
       "epochs must be in [1, 100000], got " + std::to_string(epochs));
  need(max_steps >= 0, "max_steps must be >= 0, got " + std::to_string(max_steps));
  need(batch_size >= 1 && batch_size <= 65536,
       "batch_size must be in [1, 65536], got " + std::to_string(batch_size));
  need(accum_steps >= 1 && accum_steps <= 1024,
       "accum_steps must be in [1, 1024], got " + std::to_string(accum_steps));
  need(shards >= 1 && shards <= 256, "shards must be in [1, 256], got " + std::to_string(shards));
  need(ema >= 0 && ema < 1, "ema must be in [0, 1), got " + std::to_string(ema));
  need(eval_batch >= 1 && eval_batch <= 65536,
       "eval_batch must be in [1, 65536], got " + std::to_string(eval_batch));
  need(optim.lr > 0 && optim.lr < 10, "lr must be in (0, 10)");
  need(optim.warmup_steps >= 1, "warmup_steps must be >= 1");
  need(optim.weight_decay >= 0 && optim.weight_decay < 1, "weight_decay must be in [0, 1)");
  need(optim.beta1 >= 0 && optim.beta1 < 1, "beta1 must be in [0, 1)");
  need(optim.beta2 >= 0 && optim.beta2 < 1, "beta2 must be in [0, 1)");
  need(optim.adam_eps > 0, "adam_eps must be > 0");
  need(optim.clip_norm >= 0, "clip_norm must be >= 0");
  need(data.per_language >= 10 && data.per_language <= 10'000'000,
       "per_language must be in [10, 10000000]");
  need(model.max_len >= 3, "max_len must be at least 3 ([CLS], one character, [SEP])");
  model.validate();
}

namespace {

// ---- progress and metrics ------------------------------------------------------------------

std::string duration(double s) {
  std::ostringstream os;
  const long t = std::lround(std::max(s, 0.0));
  if (t >= 3600)
    os << t / 3600 << "h" << std::setw(2) << std::setfill('0') << (t / 60) % 60 << "m";
  else if (t >= 60)
    os << t / 60 << "m" << std::setw(2) << std::setfill('0') << t % 60 << "s";
  else
    os << t << "s";
  return os.str();
}

struct Metrics {
  std::string path;
  std::vector<std::string> rows;
  void load() {
    std::ifstream in(path);
    std::string line;
    rows.clear();
    while (std::getline(in, line)) {
      if (!line.empty() && !line.starts_with("split,")) rows.push_back(line);
    }
  }
  void add(const std::string& split, index_t epoch, index_t step, double loss, double acc,
           double lr, double tps) {
    std::ostringstream os;
    os << split << "," << epoch << "," << step << "," << std::setprecision(9) << loss << "," << acc
       << "," << lr << "," << std::setprecision(6) << tps;
    rows.push_back(os.str());
    std::string text = "split,epoch,step,loss,accuracy,lr,tokens_per_s\n";
    for (const auto& r : rows) text += r + "\n";
    st::write_file_atomic(path, text, true);
  }
};

// Draws loss and accuracy against the step with gnuplot; returns false when gnuplot is missing.
bool plot_curves(const std::string& csv, const std::string& png) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) return false;
  const std::string tmp = png + ".tmp.png";
  const std::string script =
      "set terminal png size 1100,420\n"
      "set output '" +
      tmp +
      "'\n"
      "set datafile separator ','\n"
      "set key autotitle columnhead\n"
      "set multiplot layout 1,2\n"
      "set title 'loss'\nset xlabel 'step'\nset grid\n"
      "plot '" +
      csv +
      "' using (strcol(1) eq 'train' ? $3 : NaN):4 with lines title 'train', "
      "'' using (strcol(1) eq 'valid' ? $3 : NaN):4 with linespoints title 'validation'\n"
      "set title 'accuracy'\nset yrange [0:1]\n"
      "plot '" +
      csv +
      "' using (strcol(1) eq 'train' ? $3 : NaN):5 with lines title 'train', "
      "'' using (strcol(1) eq 'valid' ? $3 : NaN):5 with linespoints title 'validation'\n"
      "unset multiplot\n";
  const std::string script_path = png + ".gp";
  {
    std::ofstream s(script_path);
    s << script;
  }
  const int rc = std::system(("gnuplot '" + script_path + "' >/dev/null 2>&1").c_str());
  fs::remove(script_path);
  if (rc != 0) {
    fs::remove(tmp);
    return false;
  }
  fs::rename(tmp, png);
  return true;
}

// ---- evaluation ----------------------------------------------------------------------------

struct Eval {
  double loss = 0, accuracy = 0;
  std::vector<std::vector<index_t>> confusion;  // [true][predicted]
};

template <class Real>
std::vector<Real> softmax_row(const Tensor<Real>& logits, index_t b, index_t C) {
  std::vector<Real> p(static_cast<std::size_t>(C));
  Real m = logits[b * C];
  for (index_t c = 1; c < C; ++c) m = std::max(m, logits[b * C + c]);
  Real sum = 0;
  for (index_t c = 0; c < C; ++c)
    sum += p[static_cast<std::size_t>(c)] = std::exp(logits[b * C + c] - m);
  for (auto& x : p) x /= sum;
  return p;
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

// Loss and accuracy over `set` in batches of eval_batch. The batches run in parallel, one pass
// per task on its own thread; their results are summed in batch order.
template <class Real>
Eval evaluate(const Params<Real>& params, const train::Vocab& vocab,
              const std::vector<train::Example>& set, index_t eval_batch) {
  const index_t C = params.config.num_classes;
  Eval e;
  e.confusion.assign(static_cast<std::size_t>(C),
                     std::vector<index_t>(static_cast<std::size_t>(C), 0));
  if (set.empty()) return e;
  const std::size_t eb = static_cast<std::size_t>(eval_batch);
  const std::size_t n_batches = (set.size() + eb - 1) / eb;
  struct Result {
    double loss_sum = 0;
    std::vector<index_t> predicted;
  };
  std::vector<Result> results(n_batches);
  const std::int64_t workers =
      std::min<std::int64_t>(num_threads(), static_cast<std::int64_t>(n_batches));
  parallel_tasks(workers, [&](std::int64_t w) {
    Activations<Real> acts;
    for (std::size_t k = static_cast<std::size_t>(w); k < n_batches;
         k += static_cast<std::size_t>(workers)) {
      std::vector<const train::Example*> ex;
      for (std::size_t i = k * eb; i < std::min(set.size(), (k + 1) * eb); ++i)
        ex.push_back(&set[i]);
      const Batch b = train::make_batch(vocab, ex, params.config.max_len);
      forward(params, b, acts, {.train = false, .dropout_seed = 0});
      results[k].loss_sum = static_cast<double>(acts.loss[0]) * static_cast<double>(b.batch);
      for (index_t i = 0; i < b.batch; ++i)
        results[k].predicted.push_back(predicted_class(acts.logits, i, C));
    }
  });
  double loss_sum = 0;
  index_t correct = 0;
  for (std::size_t k = 0; k < n_batches; ++k) {
    loss_sum += results[k].loss_sum;
    for (std::size_t i = 0; i < results[k].predicted.size(); ++i) {
      const auto y = set[k * eb + i].label;
      const index_t best = results[k].predicted[i];
      correct += best == y;
      ++e.confusion[static_cast<std::size_t>(y)][static_cast<std::size_t>(best)];
    }
  }
  e.loss = loss_sum / static_cast<double>(set.size());
  e.accuracy = static_cast<double>(correct) / static_cast<double>(set.size());
  return e;
}

// ---- checkpoints -----------------------------------------------------------------------------

struct Position {
  index_t epoch = 0;        // the epoch in progress (0-based)
  index_t micro = 0;        // the next micro-batch of that epoch
  index_t step = 0;         // optimizer steps taken
  index_t micro_total = 0;  // micro-batches run, over all epochs (the dropout counter)
};

template <class Real>
void add_params(st::File& f, const std::string& prefix, const Params<Real>& p) {
  p.visit([&](const std::string& n, const Tensor<Real>& t) {
    f.add<Real>(prefix + n, t.shape().dims(), t.data(), static_cast<std::size_t>(t.numel()));
  });
}

template <class Real>
void load_params(const st::File& f, const std::string& prefix, Params<Real>& p,
                 const std::string& path) {
  p.visit([&](const std::string& n, Tensor<Real>& t) {
    const auto* src = f.find(prefix + n);
    if (!src || src->dtype != st::dtype_of<Real>() || src->shape != t.shape().dims()) {
      throw FormatError(path + ": checkpoint tensor " + prefix + n +
                        " is missing or has the wrong "
                        "dtype or shape for its config");
    }
    std::memcpy(t.data(), src->bytes.data(), src->bytes.size());
  });
}

json languages_json() {
  json j = json::array();
  for (const auto& l : train::languages()) j.push_back(l.code);
  return j;
}

template <class Real>
void save_checkpoint(const std::string& path, const TrainOptions& o, const train::Vocab& vocab,
                     const Params<Real>& params, const train::AdamW<Real>& adam,
                     const Params<Real>* ema, const Position& pos) {
  st::File f;
  f.metadata = {{"format", kCheckpointFormat},
                {"config", params.config.to_json().dump()},
                {"train", o.to_json().dump()},
                {"vocab", vocab.to_json().dump()},
                {"languages", languages_json().dump()},
                {"position", json{{"epoch", pos.epoch},
                                  {"micro", pos.micro},
                                  {"step", pos.step},
                                  {"micro_total", pos.micro_total}}
                                 .dump()},
                {"teo_version", TEO_VERSION}};
  add_params(f, "param.", params);
  add_params(f, "adam.m.", adam.m);
  add_params(f, "adam.v.", adam.v);
  if (ema) add_params(f, "ema.", *ema);
  st::write_file_atomic(path, st::serialize(f), true);
}

json meta_json(const st::File& f, const std::string& key, const std::string& path) {
  const std::string* s = f.meta(key);
  if (!s) throw FormatError(path + ": not a teo checkpoint (no " + key + " metadata)");
  try {
    return json::parse(*s);
  } catch (const json::exception&) {
    throw FormatError(path + ": checkpoint metadata " + key + " is not valid JSON");
  }
}

st::File read_checkpoint(const std::string& path) {
  st::File f = st::read(path);
  const std::string* fmt = f.meta("format");
  if (!fmt || *fmt != kCheckpointFormat) {
    throw FormatError(path + ": not a teo checkpoint (format is not " + kCheckpointFormat + ")");
  }
  return f;
}

// ---- the loop --------------------------------------------------------------------------------

// A permutation of [0, n) for one epoch, from the seed (Fisher-Yates over the counter generator).
std::vector<std::size_t> epoch_order(std::size_t n, std::uint64_t seed, index_t epoch) {
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = i;
  const auto stream = rng::stream_id("train.shuffle." + std::to_string(epoch));
  for (std::size_t i = n; i-- > 1;) {
    const std::size_t j = static_cast<std::size_t>(rng::bits(seed, stream, i) % (i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

// The micro-batches of one epoch: the shuffled words are cut into windows of 50 batches, each
// window is sorted by word length and sliced into batches (so that a batch pads little), and the
// batches are shuffled again. Everything follows from (seed, epoch).
std::vector<std::vector<std::size_t>> epoch_batches(const std::vector<train::Example>& set,
                                                    index_t batch_size, std::uint64_t seed,
                                                    index_t epoch) {
  const auto order = epoch_order(set.size(), seed, epoch);
  const std::size_t bs = static_cast<std::size_t>(batch_size);
  const std::size_t window = 50 * bs;
  std::vector<std::vector<std::size_t>> batches;
  for (std::size_t w = 0; w < order.size(); w += window) {
    std::vector<std::size_t> chunk(
        order.begin() + static_cast<std::ptrdiff_t>(w),
        order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), w + window)));
    std::stable_sort(chunk.begin(), chunk.end(), [&](std::size_t a, std::size_t b) {
      return set[a].word.size() < set[b].word.size();
    });
    for (std::size_t i = 0; i < chunk.size(); i += bs) {
      batches.emplace_back(
          chunk.begin() + static_cast<std::ptrdiff_t>(i),
          chunk.begin() + static_cast<std::ptrdiff_t>(std::min(chunk.size(), i + bs)));
    }
  }
  const auto perm = epoch_order(batches.size(), seed ^ 0x9e3779b97f4a7c15ULL, epoch);
  std::vector<std::vector<std::size_t>> out(batches.size());
  for (std::size_t i = 0; i < perm.size(); ++i) out[i] = std::move(batches[perm[i]]);
  return out;
}

// One part of a micro-batch and everything its pass needs, kept across steps for reuse.
template <class Real>
struct Shard {
  Batch batch;
  Activations<Real> acts, dacts;
  Params<Real> grads;
  index_t correct = 0;
};

template <class Real>
void axpy_params(Params<Real>& acc, const Params<Real>& g, Real scale) {
  train::for_each_pair(acc, g, "gradient accumulation",
                       [&](Tensor<Real>& t, const Tensor<Real>& s) {
                         for (index_t i = 0; i < t.numel(); ++i) t[i] += s[i] * scale;
                       });
}

template <class Real>
int train_typed(TrainOptions o, std::ostream& out) {
  const bool tty = o.progress && ::isatty(STDOUT_FILENO);
  const int C = static_cast<int>(train::languages().size());
  Params<Real> params;
  train::AdamW<Real> adam;
  Params<Real> ema;  // the averaged weights, when o.ema > 0
  train::Vocab vocab;
  Position pos;
  st::File ck;
  if (!o.resume.empty()) {
    ck = read_checkpoint(o.resume);
    // Every setting comes from the checkpoint, except how long to go on.
    TrainOptions saved = TrainOptions::defaults();
    try {
      saved.apply_json(meta_json(ck, "train", o.resume));
      saved.model = EncoderConfig::from_json(meta_json(ck, "config", o.resume));
    } catch (const ConfigError& e) {
      throw FormatError(o.resume + ": checkpoint settings: " + e.what());
    }
    for (const auto& [key, v] : o.given.items()) {
      (void)v;
      if (key != "epochs" && key != "max_steps" && key != "eval_batch") {
        throw ConfigError("--resume continues with the checkpoint's settings; " + key +
                          " cannot be changed (only epochs, max_steps and eval_batch can)");
      }
    }
    saved.epochs = o.epochs;
    saved.max_steps = o.max_steps;
    saved.eval_batch = o.eval_batch;
    saved.out_dir = o.out_dir;
    saved.resume = o.resume;
    saved.trace = o.trace;
    saved.progress = o.progress;
    saved.plot = o.plot;
    o = saved;
    o.validate();
  }
  const auto t_data = Clock::now();
  const train::Dataset data = train::load_words(o.data);
  if (!o.resume.empty()) {
    vocab = train::Vocab::from_json(meta_json(ck, "vocab", o.resume));
    if (vocab.size() != o.model.vocab_size) {
      throw FormatError(o.resume + ": the checkpoint's vocabulary does not match its config");
    }
    const json p = meta_json(ck, "position", o.resume);
    try {
      pos = {p.at("epoch").get<index_t>(), p.at("micro").get<index_t>(),
             p.at("step").get<index_t>(), p.at("micro_total").get<index_t>()};
    } catch (const json::exception&) {
      throw FormatError(o.resume + ": the checkpoint's position is malformed");
    }
    params = Params<Real>::zeros(o.model);
    adam = train::AdamW<Real>::zeros(o.model);
    load_params(ck, "param.", params, o.resume);
    load_params(ck, "adam.m.", adam.m, o.resume);
    load_params(ck, "adam.v.", adam.v, o.resume);
    if (o.ema > 0) {
      ema = Params<Real>::zeros(o.model);
      load_params(ck, "ema.", ema, o.resume);
    }
    adam.step = pos.step;
  } else {
    vocab = train::Vocab::build(data.train);
    o.model.vocab_size = vocab.size();
    o.model.num_classes = C;
    o.validate();
    params = Params<Real>::init(o.model, o.seed);
    adam = train::AdamW<Real>::zeros(o.model);
    if (o.ema > 0) ema = params;
  }
  // What validation, the test and predict use, and what checkpoints keep beside the parameters.
  const Params<Real>& evaluated = o.ema > 0 ? ema : params;
  const Params<Real>* kept_ema = o.ema > 0 ? &ema : nullptr;
  fs::create_directories(o.out_dir);
  Metrics metrics{(fs::path(o.out_dir) / "metrics.csv").string(), {}};
  if (!o.resume.empty()) metrics.load();

  out << "data: " << data.train.size() << " train, " << data.valid.size() << " validation, "
      << data.test.size() << " test words (";
  for (int l = 0; l < C; ++l) {
    out << (l ? ", " : "") << train::languages()[static_cast<std::size_t>(l)].code << " "
        << data.kept[static_cast<std::size_t>(l)];
  }
  out << "; " << std::accumulate(data.dropped_shared.begin(), data.dropped_shared.end(), index_t{0})
      << " entries dropped as shared between lists) in " << std::fixed << std::setprecision(1)
      << std::chrono::duration<double>(Clock::now() - t_data).count() << " s\n";
  out.unsetf(std::ios::floatfield);
  out << "model: " << o.model.to_json().dump() << "\n"
      << "  " << params.count() << " parameters, " << o.dtype << ", backend "
      << to_string(backend()) << ", " << num_threads() << " thread(s)\n";

  const index_t n_train = static_cast<index_t>(data.train.size());
  const index_t micro_per_epoch = (n_train + o.batch_size - 1) / o.batch_size;
  const index_t steps_per_epoch = (micro_per_epoch + o.accum_steps - 1) / o.accum_steps;
  index_t total_steps = steps_per_epoch * o.epochs;
  if (o.max_steps > 0) total_steps = std::min(total_steps, o.max_steps);
  const index_t log_every = std::max<index_t>(1, steps_per_epoch / 20);

  // The trace: every step's batches, loss, lr and gradient norm, for the exactness test.
  st::File trace;
  if (!o.trace.empty()) {
    trace.metadata = {{"format", "teo-train-trace/1"},
                      {"config", o.model.to_json().dump()},
                      {"train", o.to_json().dump()}};
    add_params(trace, "init.", params);
  }

  Params<Real> grads = Params<Real>::zeros(o.model);
  std::vector<Shard<Real>> shards(static_cast<std::size_t>(o.shards));
  const auto dropout_stream = rng::stream_id("train.dropout");
  const auto t_start = Clock::now();
  const index_t start_step = pos.step;
  double window_loss = 0, window_tokens = 0;
  index_t window_correct = 0, window_words = 0, window_steps = 0;
  auto window_start = Clock::now();
  bool stop = pos.step >= total_steps;

  while (!stop && pos.epoch < o.epochs) {
    const auto batches = epoch_batches(data.train, o.batch_size, o.seed, pos.epoch);
    while (!stop && pos.micro < micro_per_epoch) {
      const index_t n_micro = std::min(o.accum_steps, micro_per_epoch - pos.micro);
      grads.visit([](const std::string&, Tensor<Real>& t) { t.zero(); });
      double step_loss = 0;
      for (index_t m = 0; m < n_micro; ++m) {
        const auto& members = batches[static_cast<std::size_t>(pos.micro + m)];
        const index_t n = static_cast<index_t>(members.size());
        const index_t n_shards = std::min(o.shards, n);
        const auto micro_id = static_cast<std::uint64_t>(pos.micro_total + m);
        parallel_tasks(n_shards, [&](std::int64_t s) {
          Shard<Real>& sh = shards[static_cast<std::size_t>(s)];
          std::vector<const train::Example*> ex;
          for (index_t i = n * s / n_shards; i < n * (s + 1) / n_shards; ++i)
            ex.push_back(&data.train[members[static_cast<std::size_t>(i)]]);
          sh.batch = train::make_batch(vocab, ex, o.model.max_len);
          const std::uint64_t dseed = rng::bits(
              o.seed, dropout_stream,
              micro_id * static_cast<std::uint64_t>(o.shards) + static_cast<std::uint64_t>(s));
          forward(params, sh.batch, sh.acts, {.train = true, .dropout_seed = dseed});
          backward(params, sh.batch, sh.acts, sh.grads, sh.dacts);
          sh.correct = 0;
          for (index_t i = 0; i < sh.batch.batch; ++i) {
            sh.correct += predicted_class(sh.acts.logits, i, C) ==
                          sh.batch.labels[static_cast<std::size_t>(i)];
          }
        });
        // Each part's loss and gradient are means over its words: weight them by its share.
        for (index_t s = 0; s < n_shards; ++s) {
          const Shard<Real>& sh = shards[static_cast<std::size_t>(s)];
          const double share = static_cast<double>(sh.batch.batch) / static_cast<double>(n);
          axpy_params(grads, sh.grads, static_cast<Real>(share / static_cast<double>(n_micro)));
          step_loss += share * static_cast<double>(sh.acts.loss[0]);
          window_correct += sh.correct;
          window_words += sh.batch.batch;
          for (auto len : sh.batch.lengths) window_tokens += static_cast<double>(len);
        }
        if (!o.trace.empty()) {
          std::vector<const train::Example*> ex;
          for (std::size_t i : members) ex.push_back(&data.train[i]);
          const Batch b = train::make_batch(vocab, ex, o.model.max_len);
          const std::string p =
              "step." + std::to_string(pos.step + 1) + "." + std::to_string(m) + ".";
          trace.add<std::int64_t>(p + "tokens", {b.batch, b.seq_len}, b.tokens.data(),
                                  b.tokens.size());
          trace.add<std::int64_t>(p + "lengths", {b.batch}, b.lengths.data(), b.lengths.size());
          trace.add<std::int64_t>(p + "labels", {b.batch}, b.labels.data(), b.labels.size());
        }
      }
      step_loss /= static_cast<double>(n_micro);
      const double norm = train::global_norm(grads);
      train::clip_by_norm(grads, norm, o.optim.clip_norm);
      const double lr = train::learning_rate(o.optim, pos.step + 1);
      adam.update(params, grads, o.optim, lr);
      if (kept_ema) train::ema_update(ema, params, train::ema_decay(o.ema, pos.step + 1));
      pos.step += 1;
      pos.micro += n_micro;
      pos.micro_total += n_micro;
      if (!o.trace.empty()) {
        const std::string p = "step." + std::to_string(pos.step) + ".";
        trace.add<double>(p + "loss", {}, &step_loss, 1);
        trace.add<double>(p + "lr", {}, &lr, 1);
        trace.add<double>(p + "grad_norm", {}, &norm, 1);
      }
      window_loss += step_loss;
      ++window_steps;
      if (!std::isfinite(step_loss)) {
        throw Error("training diverged: the loss at step " + std::to_string(pos.step) +
                    " is not finite (lower --lr)");
      }
      stop = o.max_steps > 0 && pos.step >= o.max_steps;
      const bool epoch_end = pos.micro >= micro_per_epoch;
      if (pos.step % log_every == 0 || epoch_end || stop) {
        const double secs = std::chrono::duration<double>(Clock::now() - window_start).count();
        const double tps = window_tokens / std::max(secs, 1e-9);
        const double loss = window_loss / static_cast<double>(window_steps);
        const double acc = static_cast<double>(window_correct) /
                           static_cast<double>(std::max<index_t>(window_words, 1));
        metrics.add("train", pos.epoch + 1, pos.step, loss, acc, lr, tps);
        const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
        const double eta = elapsed / static_cast<double>(pos.step - start_step) *
                           static_cast<double>(total_steps - pos.step);
        std::ostringstream line;
        line << "epoch " << pos.epoch + 1 << "/" << o.epochs << "  step " << pos.step << "/"
             << total_steps << "  loss " << std::fixed << std::setprecision(4) << loss << "  acc "
             << std::setprecision(3) << acc << "  " << std::setprecision(0) << tps << " tok/s  ETA "
             << duration(eta);
        if (tty) {
          const int width = 24;
          const int filled = static_cast<int>(width * pos.step / std::max<index_t>(total_steps, 1));
          out << "\r[" << std::string(static_cast<std::size_t>(filled), '#')
              << std::string(static_cast<std::size_t>(width - filled), '.') << "] " << line.str()
              << "   " << std::flush;
        } else {
          out << line.str() << "\n";
        }
        window_loss = window_tokens = 0;
        window_correct = window_words = window_steps = 0;
        window_start = Clock::now();
      }
    }
    if (pos.micro >= micro_per_epoch) {
      if (tty) out << "\n";
      const Eval v = evaluate(evaluated, vocab, data.valid, o.eval_batch);
      metrics.add("valid", pos.epoch + 1, pos.step, v.loss, v.accuracy,
                  train::learning_rate(o.optim, pos.step), 0);
      pos.epoch += 1;
      pos.micro = 0;
      const std::string saved_at =
          (fs::path(o.out_dir) / ("checkpoint-epoch" + std::to_string(pos.epoch) + ".safetensors"))
              .string();
      save_checkpoint(saved_at, o, vocab, params, adam, kept_ema, pos);
      save_checkpoint((fs::path(o.out_dir) / "checkpoint.safetensors").string(), o, vocab, params,
                      adam, kept_ema, pos);
      out << "epoch " << pos.epoch << ": validation loss " << std::fixed << std::setprecision(4)
          << v.loss << ", accuracy " << std::setprecision(4) << v.accuracy << "  (saved "
          << saved_at << ")\n";
      out.unsetf(std::ios::floatfield);
    }
  }
  if (stop && pos.micro != 0) {
    if (tty) out << "\n";
    save_checkpoint((fs::path(o.out_dir) / "checkpoint.safetensors").string(), o, vocab, params,
                    adam, kept_ema, pos);
    out << "stopped at step " << pos.step << " (max_steps); saved "
        << (fs::path(o.out_dir) / "checkpoint.safetensors").string() << "\n";
  }
  if (!o.trace.empty()) {
    add_params(trace, "final.", params);
    trace.metadata.emplace_back("steps", std::to_string(pos.step - start_step));
    st::write_file_atomic(o.trace, st::serialize(trace), true);
    out << "trace: " << o.trace << "\n";
  }

  // The yardstick and the result.
  const Eval test = evaluate(evaluated, vocab, data.test, o.eval_batch);
  train::NaiveBayes nb;
  nb.fit(data.train, C);
  index_t nb_correct = 0;
  for (const auto& e : data.test) nb_correct += nb.predict(e.word) == e.label;
  const double nb_acc =
      data.test.empty() ? 0
                        : static_cast<double>(nb_correct) / static_cast<double>(data.test.size());
  const double total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  out << "\ntest accuracy: " << std::fixed << std::setprecision(4) << test.accuracy
      << "   (character-trigram naive Bayes on the same split: " << nb_acc << ")\n";
  out << "confusion matrix (rows: true language, columns: predicted)\n      ";
  for (const auto& l : train::languages()) out << std::setw(7) << l.code;
  out << "\n";
  for (int t = 0; t < C; ++t) {
    out << "  " << std::setw(4) << std::left << train::languages()[static_cast<std::size_t>(t)].code
        << std::right;
    for (int p = 0; p < C; ++p)
      out << std::setw(7)
          << test.confusion[static_cast<std::size_t>(t)][static_cast<std::size_t>(p)];
    out << "\n";
  }
  out << "training time " << duration(total_s) << "\n";
  const json summary = {{"test_accuracy", test.accuracy}, {"naive_bayes_test_accuracy", nb_acc},
                        {"test_loss", test.loss},         {"steps", pos.step},
                        {"epochs_completed", pos.epoch},  {"seconds", total_s},
                        {"confusion", test.confusion},    {"languages", languages_json()}};
  st::write_file_atomic((fs::path(o.out_dir) / "summary.json").string(), summary.dump(2) + "\n",
                        true);
  if (o.plot) {
    const std::string png = (fs::path(o.out_dir) / "curves.png").string();
    if (plot_curves(metrics.path, png))
      out << "curves: " << png << "\n";
    else
      out << "curves: gnuplot not found (apt-get install gnuplot-nox); metrics are in "
          << metrics.path << "\n";
  }
  out << "metrics: " << metrics.path
      << "\ncheckpoint: " << (fs::path(o.out_dir) / "checkpoint.safetensors").string() << "\n";
  out.unsetf(std::ios::floatfield);
  return 0;
}

template <class Real>
int predict_typed(const st::File& ck, const std::string& path,
                  const std::vector<std::string>& words, std::ostream& out) {
  const auto cfg = EncoderConfig::from_json(meta_json(ck, "config", path));
  const auto vocab = train::Vocab::from_json(meta_json(ck, "vocab", path));
  auto params = Params<Real>::zeros(cfg);
  // The averaged weights when training kept them (they are what the test accuracy measured).
  const bool averaged = std::any_of(ck.tensors.begin(), ck.tensors.end(),
                                    [](const auto& e) { return e.name.rfind("ema.", 0) == 0; });
  load_params(ck, averaged ? "ema." : "param.", params, path);
  const auto& langs = train::languages();
  if (cfg.num_classes != static_cast<index_t>(langs.size())) {
    throw FormatError(path + ": the checkpoint has " + std::to_string(cfg.num_classes) +
                      " classes");
  }
  std::vector<train::Example> ex;
  for (const auto& w : words) {
    bool ok = true;
    auto cps = train::utf8_decode(w, &ok);
    if (!ok) throw InputError("word \"" + w + "\" is not valid UTF-8");
    if (cps.empty()) throw InputError("an empty word cannot be classified");
    ex.push_back({cps, 0});
  }
  std::vector<const train::Example*> ptrs;
  for (const auto& e : ex) ptrs.push_back(&e);
  const Batch b = train::make_batch(vocab, ptrs, cfg.max_len);
  Activations<Real> acts;
  forward(params, b, acts, {.train = false, .dropout_seed = 0});
  for (std::size_t i = 0; i < words.size(); ++i) {
    const auto p = softmax_row(acts.logits, static_cast<index_t>(i), cfg.num_classes);
    const auto best = static_cast<std::size_t>(
        predicted_class(acts.logits, static_cast<index_t>(i), cfg.num_classes));
    out << words[i] << ": " << langs[best].name << "  ";
    for (std::size_t c = 0; c < p.size(); ++c) {
      out << " " << langs[c].code << " " << std::fixed << std::setprecision(3)
          << static_cast<double>(p[c]);
    }
    out << "\n";
  }
  out.unsetf(std::ios::floatfield);
  return 0;
}

}  // namespace

int run_train(const TrainOptions& opts, std::ostream& out) {
  if (opts.resume.empty()) opts.validate();
  std::string dtype = opts.dtype;
  if (!opts.resume.empty()) {
    const st::File ck = read_checkpoint(opts.resume);
    dtype = meta_json(ck, "train", opts.resume).at("dtype").get<std::string>();
  }
  return dtype == "float64" ? train_typed<double>(opts, out) : train_typed<float>(opts, out);
}

int run_predict(const std::string& checkpoint, const std::vector<std::string>& words,
                std::ostream& out) {
  const st::File ck = read_checkpoint(checkpoint);
  const std::string dtype = meta_json(ck, "train", checkpoint).at("dtype").get<std::string>();
  return dtype == "float64" ? predict_typed<double>(ck, checkpoint, words, out)
                            : predict_typed<float>(ck, checkpoint, words, out);
}

}  // namespace teo::cli
