#include "teo/train/checkpoint.hpp"

#include <cstring>

#include <nlohmann/json.hpp>

#include "teo/files.hpp"

namespace teo::train {

namespace {

using nlohmann::json;
namespace st = safetensors;

json meta_json(const st::File& f, const std::string& key, const std::string& path) {
  const std::string* s = f.meta(key);
  if (!s) throw FormatError(path + ": not a teo checkpoint (no " + key + " metadata)");
  try {
    return json::parse(*s);
  } catch (const json::exception&) {
    throw FormatError(path + ": checkpoint metadata " + key + " is not valid JSON");
  }
}

}  // namespace

json languages_json() {
  json j = json::array();
  for (const auto& l : languages()) j.push_back(l.code);
  return j;
}

template <class Real>
void add_params(st::File& f, const std::string& prefix, const Params<Real>& p) {
  p.visit([&](const std::string& n, const Tensor<Real>& t) {
    f.add<Real>(prefix + n, t.shape().dims(), t.data(), static_cast<std::size_t>(t.numel()));
  });
}

template <class Real>
Params<Real> load_params(const st::File& f, const std::string& prefix, const ModelConfig& cfg,
                         const std::string& path) {
  auto p = Params<Real>::zeros(cfg);
  p.visit([&](const std::string& n, Tensor<Real>& t) {
    const auto* src = f.find(prefix + n);
    if (!src || src->dtype != st::dtype_of<Real>() || src->shape != t.shape().dims()) {
      throw FormatError(path + ": checkpoint tensor " + prefix + n +
                        " is missing or has the wrong "
                        "dtype or shape for its config");
    }
    std::memcpy(t.data(), src->bytes.data(), src->bytes.size());
  });
  return p;
}

Checkpoint read_checkpoint(const std::string& path) {
  Checkpoint ck;
  ck.path = path;
  ck.file = st::read(path);
  const std::string* fmt = ck.file.meta("format");
  if (!fmt || *fmt != kCheckpointFormat) {
    throw FormatError(path + ": not a teo checkpoint (format is not " + kCheckpointFormat + ")");
  }
  try {
    ck.options.apply_json(meta_json(ck.file, "train", path));
    ck.options.model = ModelConfig::from_json(meta_json(ck.file, "config", path));
    ck.options.validate();
  } catch (const ConfigError& e) {
    throw FormatError(path + ": checkpoint settings: " + e.what());
  }
  ck.vocab = Vocab::from_json(meta_json(ck.file, "vocab", path));
  if (ck.vocab.size() != ck.options.model.embeddings.vocab_size) {
    throw FormatError(path + ": the checkpoint's vocabulary does not match its config");
  }
  const json p = meta_json(ck.file, "position", path);
  try {
    ck.position = {p.at("epoch").get<index_t>(), p.at("micro").get<index_t>(),
                   p.at("step").get<index_t>(), p.at("micro_total").get<index_t>()};
  } catch (const json::exception&) {
    throw FormatError(path + ": the checkpoint's position is malformed");
  }
  // Resuming indexes the epoch's batch order with micro: every field must be a count, and a step
  // takes at least one micro-batch.
  const Position& q = ck.position;
  for (const auto& [name, v] :
       {std::pair{"epoch", q.epoch}, std::pair{"micro", q.micro}, std::pair{"step", q.step},
        std::pair{"micro_total", q.micro_total}}) {
    if (v < 0) {
      throw FormatError(path + ": the checkpoint's position has " + name + " = " +
                        std::to_string(v) + ", below 0");
    }
  }
  if (q.step > q.micro_total || q.micro > q.micro_total) {
    throw FormatError(path + ": the checkpoint's position is inconsistent: step " +
                      std::to_string(q.step) + " and micro " + std::to_string(q.micro) +
                      " cannot exceed micro_total " + std::to_string(q.micro_total));
  }
  return ck;
}

namespace {

bool how_long(const std::string& key) {
  return key == "epochs" || key == "max_steps" || key == "eval_batch";
}

}  // namespace

TrainOptions resume_options(const Checkpoint& ck, const TrainOptions& requested) {
  const json saved = ck.options.all_keys();
  for (const auto& [key, v] : requested.given.items()) {
    if (how_long(key)) continue;
    // A key given with the checkpoint's own value (the same --config file again) changes nothing.
    TrainOptions probe = ck.options;
    probe.apply_json(json{{key, v}});
    // (a key at its default is absent from both: the whole settings are compared)
    if (probe.all_keys() != saved) {
      throw ConfigError("--resume continues with the checkpoint's settings; " + key +
                        " cannot be changed from " +
                        (saved.contains(key) ? saved.at(key).dump() : "its default") + " to " +
                        v.dump() + " (only epochs, max_steps and eval_batch can)");
    }
  }
  TrainOptions o = ck.options;
  // How long to go on: the checkpoint's plan unless a flag or the config file says otherwise.
  if (requested.given.contains("epochs")) o.epochs = requested.epochs;
  if (requested.given.contains("max_steps")) o.max_steps = requested.max_steps;
  if (requested.given.contains("eval_batch")) o.eval_batch = requested.eval_batch;
  o.out_dir = requested.out_dir;
  o.resume = requested.resume;
  o.trace = requested.trace;
  o.progress = requested.progress;
  o.plot = requested.plot;
  o.given = requested.given;
  o.validate();
  return o;
}

template <class Real>
TrainState<Real> load_state(const Checkpoint& ck) {
  const ModelConfig& cfg = ck.options.model;
  TrainState<Real> s;
  s.params = load_params<Real>(ck.file, "param.", cfg, ck.path);
  s.adam.m = load_params<Real>(ck.file, "adam.m.", cfg, ck.path);
  s.adam.v = load_params<Real>(ck.file, "adam.v.", cfg, ck.path);
  s.adam.step = ck.position.step;
  if (ck.options.ema > 0) s.ema = load_params<Real>(ck.file, "ema.", cfg, ck.path);
  return s;
}

template <class Real>
void save_checkpoint(const std::string& path, const TrainOptions& o, const Vocab& vocab,
                     const TrainState<Real>& state, const Position& pos) {
  st::File f;
  f.metadata = {{"format", kCheckpointFormat},
                {"config", state.params.config.to_json().dump()},
                {"train", o.to_json().dump()},
                {"vocab", vocab.to_json().dump()},
                {"languages", languages_json().dump()},
                {"position", json{{"epoch", pos.epoch},
                                  {"micro", pos.micro},
                                  {"step", pos.step},
                                  {"micro_total", pos.micro_total}}
                                 .dump()},
                {"teo_version", TEO_VERSION}};
  add_params(f, "param.", state.params);
  add_params(f, "adam.m.", state.adam.m);
  add_params(f, "adam.v.", state.adam.v);
  if (o.ema > 0) add_params(f, "ema.", state.ema);
  write_file_atomic(path, st::serialize(f), true);
}

#define TEO_INSTANTIATE(Real)                                                                \
  template void add_params(st::File&, const std::string&, const Params<Real>&);              \
  template Params<Real> load_params(const st::File&, const std::string&, const ModelConfig&, \
                                    const std::string&);                                     \
  template TrainState<Real> load_state(const Checkpoint&);                                   \
  template void save_checkpoint(const std::string&, const TrainOptions&, const Vocab&,       \
                                const TrainState<Real>&, const Position&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)
#undef TEO_INSTANTIATE

}  // namespace teo::train
