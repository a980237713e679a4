#include "teo/golden.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

#include "golden/check_routing.hpp"
#include "golden/quantized_params.hpp"
#include "golden/sink.hpp"
#include "golden_internal.hpp"
#include "teo/contract.hpp"
#include "teo/files.hpp"
#include "teo/generate.hpp"
#include "teo/golden_ops.hpp"
#include "teo/model.hpp"
#include "teo/names.hpp"
#include "teo/rng.hpp"

namespace teo::golden {

namespace detail {

index_t longest_reduction(const Case& c) {
  const ModelConfig& cfg = c.config;
  // a decoder's LM head also sums over the vocabulary (its softmax, and dx = dlogits W)
  // an encoder_decoder's target sums over its length too; the output projection over H Dh
  return std::max(
      {cfg.d_model, cfg.attn_width(), cfg.ffn.d_ff, c.seq_len, c.batch * c.seq_len, c.tgt_len,
       c.batch * c.tgt_len, cfg.lm() ? cfg.target_vocab() : index_t{1},
       // the patch embedding sums over a flattened patch, Ch P P
       cfg.embeddings.channels * cfg.embeddings.patch_size * cfg.embeddings.patch_size});
}

}  // namespace detail

namespace {

using detail::FileSink;
using detail::MemorySink;
using detail::Metadata;
using detail::Out;
using detail::out_of;
using detail::Sink;
using nlohmann::json;
using safetensors::DType;
using safetensors::File;

std::vector<std::int64_t> dims_of(const Shape& s) {
  return s.dims();
}

template <class Real>
struct Run {
  Activations<Real> acts, dacts;
  Params<Real> grads;
};

// An MoE model's routing, by layer (ForwardOptions::routing).
using LayerRouting = std::map<index_t, std::vector<std::int32_t>>;

template <class Real>
LayerRouting routing_of(const ModelConfig& cfg, const Activations<Real>& acts) {
  LayerRouting r;
  for (index_t i = 0; i < cfg.num_layers; ++i)
    if (cfg.moe_layer(i)) r[i] = acts.layers[static_cast<std::size_t>(i)].moe.routing.ids;
  return r;
}

template <class Real>
Run<Real> run_case(const Params<Real>& params, const Batch& batch, std::uint64_t seed,
                   std::optional<Precision> precision = std::nullopt,
                   const std::optional<Fp8Recipe>& fp8 = std::nullopt,
                   const LayerRouting* routing = nullptr) {
  Run<Real> r;
  forward(params, batch, r.acts,
          {.train = true,
           .dropout_seed = seed,
           .precision = precision,
           .fp8 = fp8,
           .routing = routing && !routing->empty() ? routing : nullptr});
  // the contract holds only each layer's output gradient: the rest need not outlive its layer
  backward(params, batch, r.acts, r.grads, r.dacts,
           {.precision = precision, .fp8 = fp8, .layer_activation_grads = false});
  return r;
}

// A run's tensors under their golden names, in the contract's order: the activations, then (with
// `backward`) the gradients. The contract names them; the run only supplies the values.
template <class Real>
std::vector<std::pair<std::string, const Tensor<Real>*>> computed_tensors(const ModelConfig& cfg,
                                                                          const Batch& batch,
                                                                          const Run<Real>& run,
                                                                          bool backward) {
  std::map<std::string, const Tensor<Real>*> by_name;
  run.acts.visit([&](const std::string& n, const Tensor<Real>& t) { by_name["act." + n] = &t; });
  if (backward) {
    run.dacts.visit(
        [&](const std::string& n, const Tensor<Real>& t) { by_name["grad.act." + n] = &t; });
    run.grads.visit(
        [&](const std::string& n, const Tensor<Real>& t) { by_name["grad." + n] = &t; });
  }
  const contract::Sizes sizes{batch.batch, batch.seq_len, 0, batch.tgt_len};
  std::vector<std::pair<std::string, const Tensor<Real>*>> out;
  const auto add = [&](const contract::TensorSpec& spec) {
    const auto it = by_name.find(spec.name);
    if (it == by_name.end() || it->second->shape().dims() != spec.shape) {
      throw std::logic_error("the run holds no " + spec.name + " of the contract's shape " +
                             spec.symbolic());
    }
    out.emplace_back(spec.name, it->second);
  };
  for (auto t : contract::activations(cfg, sizes)) {
    if (t.dtype == contract::DTypeRule::i32) continue;  // the routing's (moe_outs)
    t.name = "act." + t.name;
    add(t);
  }
  if (backward) {
    for (const auto& t : contract::gradients(cfg, sizes)) add(t);
  }
  return out;
}

// The dropout masks of a run, by their golden names (none when dropout is off).
template <class Real>
std::vector<std::pair<contract::TensorSpec, const std::vector<std::uint8_t>*>> run_masks(
    const ModelConfig& cfg, const Batch& batch, const Activations<Real>& acts) {
  std::vector<std::pair<contract::TensorSpec, const std::vector<std::uint8_t>*>> out;
  if (cfg.dropout <= 0) return out;
  std::map<std::string, const std::vector<std::uint8_t>*> by_site = {
      {"dropout.input", &acts.input_mask}};
  for (std::size_t i = 0; i < acts.layers.size(); ++i) {
    const auto& m = acts.layers[i].masks;
    const std::string p = "dropout.layers." + std::to_string(i) + ".";
    by_site[p + "attn"] = &m.attn;
    by_site[p + "residual1"] = &m.residual1;
    by_site[p + "ffn"] = &m.ffn;
    by_site[p + "residual2"] = &m.residual2;
  }
  for (auto& t : contract::masks(cfg, {batch.batch, batch.seq_len})) {
    const auto* m = by_site.at(t.name);
    if (static_cast<index_t>(m->size()) != Shape(t.shape).numel())
      throw std::logic_error("the run's " + t.name + " is not of the contract's shape");
    out.emplace_back(std::move(t), m);
  }
  return out;
}

// A run's dropout masks, activations and (with backward) gradients under their golden names, with
// `prefix` before each name; an MoE layer's routing and grouped layout among the activations.
template <class Real>
std::vector<Out> run_outs(const ModelConfig& cfg, const Batch& batch, const Run<Real>& run,
                          bool masks, bool with_backward, const std::string& prefix = "") {
  std::vector<Out> out;
  for (std::size_t i = 0; i < run.acts.layers.size(); ++i) {
    const auto& m = run.acts.layers[i].moe;
    if (!cfg.moe_layer(static_cast<index_t>(i))) continue;
    const auto put = [&](const char* what, const std::vector<std::int32_t>& v, const Shape& shape) {
      out.push_back(out_of(prefix + "act.layers." + std::to_string(i) + ".moe." + what,
                           shape.dims(), v.data(), v.size()));
    };
    put("topk_ids", m.routing.ids, {batch.batch, batch.seq_len, cfg.ffn.moe.num_experts_per_tok});
    put("expert_offsets", m.offsets, {static_cast<index_t>(m.offsets.size())});
    put("source_rows", m.source_rows, {static_cast<index_t>(m.source_rows.size())});
  }
  if (masks) {
    for (const auto& [t, m] : run_masks(cfg, batch, run.acts))
      out.push_back(out_of(prefix + t.name, t.shape, m->data(), m->size()));
  }
  for (const auto& [n, t] : computed_tensors(cfg, batch, run, with_backward))
    out.push_back(out_of(prefix + n, *t));
  return out;
}

// A generation case's steps (eval mode, through the KV cache) and their tensors: the fed tokens
// (T, B) and each step's logits under `prefix`. With `feed` the steps take those tokens (the
// float64 reference of a float32 case takes the float32 run's); the generation is returned so its
// tensors outlive the outs.
template <class Real>
std::vector<Out> generation_outs(const Params<Real>& params, const Batch& batch, index_t steps,
                                 const std::vector<std::vector<std::int64_t>>* feed,
                                 std::optional<Generation<Real>>& gen,
                                 std::vector<std::int64_t>& fed, const std::string& prefix) {
  std::vector<Out> out;
  if (steps <= 0) return out;
  gen = generate(params, batch, {.steps = steps, .feed = feed});
  fed.clear();
  for (const auto& row : gen->tokens) fed.insert(fed.end(), row.begin(), row.end());
  if (prefix.empty())
    out.push_back(out_of("input.generate.tokens", {steps, batch.batch}, fed.data(), fed.size()));
  for (index_t t = 0; t < steps; ++t)
    out.push_back(out_of(prefix + "act.generate." + std::to_string(t) + ".logits",
                         gen->logits[static_cast<std::size_t>(t)]));
  return out;
}

// The header of a model case: every tensor of the contract in file order, its dtype rule resolved.
std::vector<safetensors::Entry> header_entries(const Case& c, bool f32) {
  std::vector<safetensors::Entry> entries;
  for (const auto& t : contract::model_case(c.config, c.sizes(), f32))
    entries.push_back({t.name, detail::stored_dtype(t.dtype, f32), t.shape});
  return entries;
}

void add_outs(File& f, const std::vector<Out>& outs) {
  for (const auto& o : outs) f.add(o.name, o.dtype, o.shape, o.data, o.bytes);
}

std::string gigabytes(std::uint64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(bytes < 100'000'000 ? 3 : 2)
     << static_cast<double>(bytes) / 1e9 << " GB";
  return os.str();
}

// Case::drawn_norms: each norm's weight 1 + U(-1/2, 1/2) and bias U(-1/2, 1/2), from streams of
// their own ("drawn_norms." + the parameter's name), in place of Params::init's 1 and 0.
template <class Real>
void draw_norms(Params<Real>& params, std::uint64_t seed) {
  params.visit([&](const std::string& name, Tensor<Real>& t) {
    if (name.find("norm") == std::string::npos) return;
    const double base = name.ends_with(".weight") ? 1.0 : 0.0;
    const std::uint64_t stream = rng::stream_id("drawn_norms." + name);
    for (index_t i = 0; i < t.numel(); ++i) {
      const double u = rng::uniform01(seed, stream, static_cast<std::uint64_t>(i));
      t[i] = static_cast<Real>(base + (u - 0.5));
    }
  });
}

// Generates case c into `sink`: the header, then the float32 run (or the float64 one), then for a
// float32 case its float64 reference, then the conditioning checks on what the sink holds.
template <class Real>
void generate_typed(const Case& c, const Batch& batch, Sink& sink, const GenerateOptions& opts) {
  const auto stage = [&](const std::string& s) {
    if (opts.progress) opts.progress(s);
  };
  constexpr bool f32 = std::is_same_v<Real, float>;
  const ModelConfig& cfg = c.config;
  std::optional<Params<Real>> params(Params<Real>::init(cfg, c.seed));
  if (c.drawn_norms) draw_norms(*params, c.seed);
  // a quantized model computes with its weights' exact dequantized values: the checkpoint's
  // packing, or teo's quantizer's of the drawn weights
  ops::Packed packed;
  if (opts.checkpoint) {
    stage("reading the checkpoint's parameters (" + opts.names->family + ")");
    params = names::params_from_checkpoint(*opts.checkpoint, *opts.names, cfg, std::move(*params),
                                           &packed);
    if (cfg.quantization) detail::dequantize_params(*params, packed, "the checkpoint");
  } else if (cfg.quantization) {
    packed = detail::quantize_params(*params, c.seed);
  }
  if constexpr (f32) {
    if (c.precision) round_params(*params, *c.precision);
  }
  stage(std::string(f32 ? "float32" : "float64") + " forward and backward");
  std::optional<Run<Real>> run(run_case(*params, batch, c.seed));
  const LayerRouting routing = routing_of(cfg, run->acts);

  const index_t B = c.batch, S = c.seq_len;
  const bool seq2seq = cfg.encoder_decoder();
  std::vector<Out> outs = {
      out_of(seq2seq ? "input.src_tokens" : "input.tokens", {B, S}, batch.tokens.data(),
             batch.tokens.size()),
      out_of(seq2seq ? "input.src_lengths" : "input.lengths", {B}, batch.lengths.data(),
             batch.lengths.size()),
      out_of("input.labels", {B}, batch.labels.data(), batch.labels.size()),
      out_of("input.tgt_tokens", {B, batch.tgt_len}, batch.tgt_tokens.data(),
             batch.tgt_tokens.size()),
      out_of("input.tgt_lengths", {B}, batch.tgt_lengths.data(), batch.tgt_lengths.size()),
      out_of("input.token_types", {B, S}, batch.token_types.data(), batch.token_types.size())};
  // input patches: the images in the case's float type (their values are exact in it)
  const std::vector<Real> pixels(batch.pixels.begin(), batch.pixels.end());
  outs.push_back(
      out_of("input.pixels",
             {B, cfg.embeddings.channels, cfg.embeddings.image_size, cfg.embeddings.image_size},
             pixels.data(), pixels.size()));
  std::map<index_t, std::vector<std::int64_t>> given;  // a replay case's inputs
  for (const auto& [i, ids] : routing) {
    if (!c.replay_routing) break;
    const auto& g = given[i] = {ids.begin(), ids.end()};
    outs.push_back(out_of("input.layers." + std::to_string(i) + ".moe.topk_ids",
                          {B, S, cfg.ffn.moe.num_experts_per_tok}, g.data(), g.size()));
  }
  params->visit([&](const std::string& n, const Tensor<Real>& t) {
    outs.push_back(out_of("param." + n, t));
  });
  for (const auto& t : contract::packed(cfg)) {
    const auto& bytes = packed.at(t.name);
    outs.push_back(
        {t.name, detail::stored_dtype(t.dtype, f32), t.shape, bytes.data(), bytes.size()});
  }
  const auto computed = run_outs(cfg, batch, *run, /*masks=*/true, /*with_backward=*/true);
  outs.insert(outs.end(), computed.begin(), computed.end());
  std::optional<Generation<Real>> gen;
  std::vector<std::int64_t> fed;
  if (c.steps > 0) stage(std::string(f32 ? "float32" : "float64") + " generation");
  const auto gen_outs = generation_outs(*params, batch, c.steps, nullptr, gen, fed, "");
  outs.insert(outs.end(), gen_outs.begin(), gen_outs.end());

  // The header: every tensor of the contract, in its order; the run supplies the values.
  std::vector<safetensors::Entry> entries = header_entries(c, f32);
  if (!opts.keep.empty()) {
    std::vector<std::string> names;
    names.reserve(entries.size());
    for (const auto& e : entries) names.push_back(e.name);
    const auto kept = kept_names(names, opts.keep, /*op=*/false);
    std::vector<safetensors::Entry> k;
    for (std::size_t i = 0; i < entries.size(); ++i)
      if (kept[i]) k.push_back(std::move(entries[i]));
    entries = std::move(k);
  }
  Metadata meta = {{"format", kFormat},
                   {"config", cfg.to_json().dump()},
                   {"case", c.case_json().dump()},
                   {"teo_version", TEO_VERSION}};
  if (opts.checkpoint) meta.emplace_back("weights", opts.weights_source);
  // `kept` is known now and goes in the first header; only an ill_conditioned note, which comes
  // before it, can still change the header's length (and move the data) at the end.
  const auto with_kept = [&](Metadata m) {
    if (!opts.keep.empty()) m.emplace_back("kept", opts.keep);
    return m;
  };
  const auto poll = [&] {
    if (opts.poll) opts.poll();
  };
  std::uint64_t total = 0;
  for (const auto& e : entries) total += e.byte_size();
  stage("writing " + std::to_string(entries.size()) + " tensors, " + gigabytes(total));
  sink.begin(with_kept(meta), entries);
  for (const auto& o : outs) {
    poll();
    sink.put(o);
  }
  outs.clear();

  std::string why;
  if constexpr (f32) {
    // The same case in float64 from the same float32-valued parameters: the reference against
    // which both the golden's and a candidate's float32 errors are measured. The float32 run is
    // written and gone before it starts.
    run.reset();
    // the float64 steps are fed the float32 run's tokens (teacher forcing)
    std::vector<std::vector<std::int64_t>> feed;
    if (gen) feed = std::move(gen->tokens);
    gen.reset();
    std::optional<Params<double>> p64(Params<double>::zeros(cfg));
    std::vector<const Tensor<float>*> src;
    params->visit([&](const std::string&, const Tensor<float>& t) { src.push_back(&t); });
    std::size_t k = 0;
    p64->visit([&](const std::string&, Tensor<double>& t) {
      const Tensor<float>& s = *src[k++];
      for (index_t i = 0; i < t.numel(); ++i) t[i] = static_cast<double>(s[i]);
    });
    params.reset();
    // The float32 run's blocks are not of the float64 run's sizes: give them back, not cache them.
    memory::release_cached_memory();
    stage("float64 reference forward and backward");
    {
      // on the float32 run's experts
      const auto r64 = run_case(*p64, batch, c.seed, std::nullopt, std::nullopt, &routing);
      std::optional<Generation<double>> gen64;
      std::vector<std::int64_t> fed64;
      if (c.steps > 0) stage("float64 reference generation");
      const auto gen64_outs = generation_outs(*p64, batch, c.steps, &feed, gen64, fed64, "ref64.");
      p64.reset();
      stage("writing the float64 reference");
      for (const auto& o :
           run_outs(cfg, batch, r64, /*masks=*/false, /*with_backward=*/true, "ref64.")) {
        poll();
        sink.put(o);
      }
      for (const auto& o : gen64_outs) sink.put(o);
    }
    memory::release_cached_memory();
    stage("conditioning check");
    const File& f = sink.contents();
    why = detail::float32_conditioning(
        f, detail::longest_reduction(c), [&] { return detail::ill_conditioning_cause(f, cfg); },
        opts.allow_ill_conditioned);
    if (c.precision && why.empty()) {
      try {
        detail::precision_conditioning(f, emulate(f, *c.precision), *c.precision, &cfg);
      } catch (const IllConditioned& e) {
        if (!opts.allow_ill_conditioned) throw;
        why = e.what();
      }
    }
  }
  if (!why.empty()) meta.emplace_back("ill_conditioned", why);
  stage("finishing the file");  // the last point at which a stop leaves nothing behind
  sink.finish(with_kept(meta));
}

void generate_batch(const Case& c, const Batch& batch, Sink& sink, const GenerateOptions& opts) {
  if (c.dtype == "float32")
    generate_typed<float>(c, batch, sink, opts);
  else
    generate_typed<double>(c, batch, sink, opts);
}

// An MoE case's batch with every position's routing clear of the judged precision
// (docs/golden-format.md, "Routing"): the case is generated in memory and, while some position's
// margin is within twice its tolerance, the earliest such position of each sequence has its token
// redrawn (a causal model's earlier positions keep their routing), from a stream of its own.
Batch clear_routing(const Case& c, Batch batch, const GenerateOptions& opts) {
  const ModelConfig& cfg = c.config;
  const bool f32 = c.dtype == "float32";
  const Precision p = c.precision.value_or(Precision::fp32);
  const bool budget = p != Precision::fp64 && !(p == Precision::fp32 && f32);
  GenerateOptions quiet = opts;
  quiet.progress = nullptr;
  quiet.keep.clear();
  const index_t S = batch.seq_len, V = cfg.embeddings.vocab_size;
  const auto stream = rng::stream_id("input.tokens.routing_redraw");
  constexpr int kRedraws = 256;  // then the case is refused
  for (int attempt = 0;; ++attempt) {
    if (opts.progress) opts.progress("drawing the routing clear of " + std::string(to_string(p)));
    MemorySink m;
    generate_batch(c, batch, m, quiet);
    const File& f = m.contents();
    const auto emu = budget ? emulate(f, p) : std::map<std::string, std::vector<double>>();
    const auto unclear = detail::unclear_routing(f, cfg, f32, p, emu);
    if (unclear.empty()) return batch;
    const auto& u = unclear.front();
    if (attempt >= kRedraws || batch.tokens.empty()) {
      throw ConfigError("case: position " + std::to_string(u.position) + " of layer " +
                        std::to_string(u.layer) + " keeps a routing margin of " +
                        detail::full_digits(u.margin) + ", within twice the " + to_string(p) +
                        " tolerance " + detail::full_digits(u.tolerance) + ", after " +
                        std::to_string(attempt) + " redraws of the tokens: give another seed");
    }
    std::map<index_t, index_t> earliest;  // sequence -> position
    for (const auto& q : unclear) {
      const index_t b = q.position / S, s = q.position % S;
      if (!earliest.contains(b) || s < earliest[b]) earliest[b] = s;
    }
    for (auto [b, s] : earliest) {
      // a padded position holds the pad token: its last real token is redrawn instead
      const index_t len = batch.lengths[static_cast<std::size_t>(b)];
      if (cfg.embeddings.padding_idx && s >= len) s = std::max<index_t>(len - 1, 0);
      const auto at = static_cast<std::size_t>(b * S + s);
      batch.tokens[at] = static_cast<std::int64_t>(
          rng::bits(c.seed, stream,
                    static_cast<std::uint64_t>(attempt) * batch.tokens.size() + at) %
          static_cast<std::uint64_t>(V));
    }
  }
}

void generate_into(const Case& c, Sink& sink, const GenerateOptions& opts) {
  const Batch batch = c.config.moe() ? clear_routing(c, c.make_batch(), opts) : c.make_batch();
  generate_batch(c, batch, sink, opts);
}

}  // namespace

template <class Real>
File run_tensors(const Params<Real>& params, const Batch& batch, const RunOptions& opts) {
  Run<Real> r;
  forward(params, batch, r.acts,
          {.train = opts.train,
           .dropout_seed = opts.dropout_seed,
           .precision = opts.precision,
           .fp8 = opts.fp8,
           .masks = opts.masks,
           .routing = opts.routing});
  if (opts.backward)
    backward(params, batch, r.acts, r.grads, r.dacts,
             {.precision = opts.precision, .fp8 = opts.fp8, .layer_activation_grads = false});
  File f;
  const ModelConfig& cfg = params.config;
  add_outs(f, run_outs(cfg, batch, r, opts.train && cfg.dropout > 0, opts.backward));
  return f;
}
template File run_tensors<float>(const Params<float>&, const Batch&, const RunOptions&);
template File run_tensors<double>(const Params<double>&, const Batch&, const RunOptions&);

std::string symbolic_shape(const std::string& tensor_name) {
  try {
    return contract::symbolic(contract::dims_of(tensor_name));
  } catch (const std::invalid_argument&) {
    return "?";
  }
}

std::vector<bool> kept_names(const std::vector<std::string>& names, const std::string& patterns,
                             bool op) {
  std::vector<std::string> globs;
  for (std::size_t at = 0; at <= patterns.size();) {
    const std::size_t comma = std::min(patterns.find(',', at), patterns.size());
    std::string g = patterns.substr(at, comma - at);
    g.erase(0, g.find_first_not_of(' '));
    g.erase(g.find_last_not_of(' ') + 1);
    if (!g.empty()) globs.push_back(g);
    at = comma + 1;
  }
  if (globs.empty())
    throw ConfigError("--keep needs at least one pattern, got \"" + patterns + "\"");
  const auto matches = [](const std::string& glob, const std::string& name) {
    return ::fnmatch(glob.c_str(), name.c_str(), 0) == 0;
  };
  std::vector<bool> used(globs.size(), false), stays(names.size(), false);
  for (std::size_t k = 0; k < names.size(); ++k) {
    // a ref64 twin follows its tensor, an fp8 operand's scales follow it; inputs, parameters and
    // masks always stay
    const std::string& full = names[k];
    std::string name = full.starts_with("ref64.") ? full.substr(6) : full;
    const bool fp8 = op && name.starts_with("fp8.");
    if (fp8 && name.ends_with(".scale")) name.resize(name.size() - 6);
    if (!fp8 && !detail::is_judged(name, op)) {
      stays[k] = true;
      continue;
    }
    for (std::size_t i = 0; i < globs.size(); ++i) {
      if (matches(globs[i], name)) {
        stays[k] = true;
        used[i] = true;
      }
    }
  }
  for (std::size_t i = 0; i < globs.size(); ++i) {
    if (!used[i]) {
      throw ConfigError("--keep pattern \"" + globs[i] +
                        "\" matches no computed tensor of this case (" +
                        (op ? "output.*, grad.input.*, grad.param.*; fp8.* in an fp8 linear case"
                            : "act.*, grad.*") +
                        ")");
    }
  }
  return stays;
}

void keep_only(File& f, const std::string& patterns) {
  std::vector<std::string> names;
  for (const auto& t : f.tensors) names.push_back(t.name);
  // decided before anything changes: a bad pattern leaves f as it was
  const auto stays = kept_names(names, patterns, is_op_file(f));
  std::vector<safetensors::Tensor> kept;
  for (std::size_t k = 0; k < f.tensors.size(); ++k)
    if (stays[k]) kept.push_back(std::move(f.tensors[k]));
  f.tensors = std::move(kept);
  f.metadata.emplace_back("kept", patterns);
}

File make(const Case& c, bool allow_ill_conditioned) {
  MemorySink sink;
  GenerateOptions opts;
  opts.allow_ill_conditioned = allow_ill_conditioned;
  generate_into(c, sink, opts);
  return sink.take();
}

std::uint64_t generate_file(const Case& c, const std::string& path, const GenerateOptions& opts) {
  FileSink sink(path, opts.overwrite);
  generate_into(c, sink, opts);
  return sink.size();
}

Case case_of(const File& golden) {
  const std::string* cfg = golden.meta("config");
  const std::string* cs = golden.meta("case");
  if (!cfg || !cs) throw FormatError("the golden has no __metadata__.config and case");
  try {
    json j = json::parse(*cfg);
    j["case"] = json::parse(*cs);
    return Case::from_json(j);
  } catch (const json::exception&) {
    throw FormatError("the golden's __metadata__.config or case is not valid JSON");
  } catch (const ConfigError& e) {
    throw FormatError(std::string("the golden's __metadata__ holds a bad case: ") + e.what());
  } catch (const ShapeError& e) {
    throw FormatError(std::string("the golden's __metadata__ holds a bad case: ") + e.what());
  }
}

namespace {

// The images of an input-patches golden (validated: input.pixels is there, of the contract's
// shape and the case's float type).
std::vector<double> pixels_from(const File& golden) {
  const auto* t = golden.find("input.pixels");
  if (!t || !safetensors::is_float(t->dtype))
    throw FormatError("the golden has no float input.pixels");
  return t->float_values();
}

// A generation case's steps under precision p, without a cache: each sequence grown by the tokens
// the golden feeds it runs through the causal forward once (eval mode), and step t's logits are
// its LM logits at position lengths[b] + t, the property generate() meets to rounding.
void emulate_generation(const File& golden, const Params<float>& params, const Batch& prompt,
                        index_t steps, Precision p, const std::optional<Fp8Recipe>& fp8,
                        std::map<std::string, std::vector<double>>& out) {
  const auto* g = golden.find("input.generate.tokens");
  if (!g || g->dtype != DType::I64)
    throw FormatError("the golden has no I64 input.generate.tokens");
  const auto fed = g->values<std::int64_t>();  // (T, B)
  const index_t B = prompt.batch, S = prompt.seq_len;
  Batch grown;
  grown.batch = B;
  for (index_t b = 0; b < B; ++b)
    grown.seq_len = std::max(grown.seq_len, prompt.lengths[static_cast<std::size_t>(b)] + steps);
  grown.tokens.assign(static_cast<std::size_t>(B * grown.seq_len), 0);
  grown.lengths.resize(static_cast<std::size_t>(B));
  const auto at = [](index_t i) { return static_cast<std::size_t>(i); };
  for (index_t b = 0; b < B; ++b) {
    const index_t len = prompt.lengths[at(b)];
    for (index_t s = 0; s < len; ++s)
      grown.tokens[at(b * grown.seq_len + s)] = prompt.tokens[at(b * S + s)];
    for (index_t t = 0; t < steps; ++t)
      grown.tokens[at(b * grown.seq_len + len + t)] = fed[at(t * B + b)];
    grown.lengths[at(b)] = len + steps;
  }
  Activations<float> acts;
  forward(params, grown, acts, {.train = false, .precision = p, .fp8 = fp8});
  const index_t V = params.config.embeddings.vocab_size;
  for (index_t t = 0; t < steps; ++t) {
    std::vector<double> logits;
    logits.reserve(at(B * V));
    for (index_t b = 0; b < B; ++b) {
      const float* row =
          acts.lm_logits.data() + (b * grown.seq_len + prompt.lengths[at(b)] + t) * V;
      logits.insert(logits.end(), row, row + V);
    }
    out["act.generate." + std::to_string(t) + ".logits"] = std::move(logits);
  }
}

}  // namespace

std::map<std::string, std::vector<double>> emulate(const File& golden, Precision p) {
  validate(golden);
  if (is_op_file(golden)) return run_op(golden, p);
  const Case c = case_of(golden);
  const ModelConfig& cfg = c.config;
  if (cfg.encoder_decoder()) {
    throw ConfigError(
        "an encoder_decoder golden has no reduced-precision budget (its decoder layer emulates "
        "none): check it in its own dtype");
  }
  auto params = Params<float>::zeros(cfg);
  params.visit([&](const std::string& n, Tensor<float>& t) {
    const auto* g = golden.find("param." + n);
    if (!g || g->shape != dims_of(t.shape()) || !safetensors::is_float(g->dtype)) {
      throw FormatError("the golden has no float param." + n + " of shape " + t.shape().str());
    }
    const auto v = g->float_values();
    safetensors::release(*g);
    for (index_t i = 0; i < t.numel(); ++i)
      t[i] = static_cast<float>(v[static_cast<std::size_t>(i)]);
  });
  round_params(params, p);
  Batch batch;
  batch.batch = c.batch;
  batch.seq_len = c.seq_len;
  for (auto [name, dst] :
       {std::pair{"input.tokens", &batch.tokens}, std::pair{"input.lengths", &batch.lengths},
        std::pair{"input.labels", &batch.labels},
        std::pair{"input.token_types", &batch.token_types}}) {
    if (cfg.decoder() && std::string_view(name) == "input.labels") continue;  // it has none
    if (!cfg.embeddings.type_vocab_size && std::string_view(name) == "input.token_types") continue;
    if (cfg.patches_input() && std::string_view(name) == "input.tokens") continue;  // pixels
    const auto* t = golden.find(name);
    if (!t || t->dtype != DType::I64)
      throw FormatError(std::string("the golden has no I64 ") + name);
    *dst = t->values<std::int64_t>();
  }
  if (cfg.patches_input()) batch.pixels = pixels_from(golden);
  // Judged as fp8: an fp8 golden's own recipe; a golden of another precision takes the default one.
  std::optional<Fp8Recipe> fp8;
  if (p == Precision::fp8) fp8 = c.precision == Precision::fp8 ? c.fp8 : Fp8Recipe{};
  // the golden's routing replayed (docs/golden-format.md, "Routing"): the emulated run's error is
  // that of the experts the golden chose
  LayerRouting routing;
  for (index_t i = 0; i < cfg.num_layers; ++i) {
    const auto* t = cfg.moe_layer(i)
                        ? golden.find("act.layers." + std::to_string(i) + ".moe.topk_ids")
                        : nullptr;
    if (!t) continue;
    const auto v = t->int_values();
    routing[i].assign(v.begin(), v.end());
  }
  auto run = run_case(params, batch, c.seed, p, fp8, &routing);
  std::map<std::string, std::vector<double>> out;
  if (c.steps > 0) emulate_generation(golden, params, batch, c.steps, p, fp8, out);
  params = Params<float>();
  for (const auto& [spec, m] : run_masks(cfg, batch, run.acts)) {
    const std::string& n = spec.name;
    const auto* t = golden.find(n);
    if (!t || t->dtype != DType::U8 || t->values<std::uint8_t>() != *m) {
      throw FormatError("the golden's " + n + " is not the mask its seed " +
                        std::to_string(c.seed) + " gives: the emulated run cannot reproduce it");
    }
  }
  // Each tensor of the run is freed (and its block given back) as soon as it is copied, so that
  // the run and its copy as doubles are not both held whole: for a large case that is most of a
  // budget check's memory.
  const auto take = [&](const std::string& n, const Tensor<float>* t) {
    out[n] = {t->begin(), t->end()};
    *const_cast<Tensor<float>*>(t) = Tensor<float>();  // run is this function's own
    memory::release_cached_memory();
  };
  const auto computed = computed_tensors(cfg, batch, run, /*backward=*/true);
  for (auto it = computed.rbegin(); it != computed.rend(); ++it) take(it->first, it->second);
  return out;
}

std::vector<CorpusEntry> read_corpus_cases(const std::string& path) {
  return detail::read_corpus<CorpusEntry>(path,
                                          [](const json& spec) { return Case::from_json(spec); });
}

void generate_corpus(const std::string& dir, std::ostream& log, bool overwrite) {
  namespace fs = std::filesystem;
  const auto entries = read_corpus_cases((fs::path(dir) / "cases.json").string());
  const auto names = detail::names_of(entries);
  // golden/ops/ is the op corpus, generated after the model cases; nothing is written when
  // either would overwrite a file without `overwrite`.
  const fs::path ops = fs::path(dir) / "ops";
  std::error_code ec;
  const bool have_ops = fs::exists(ops / "cases.json", ec);
  if (!overwrite) {
    detail::refuse_existing(dir, names);
    if (have_ops) {
      detail::refuse_existing(
          ops.string(), detail::names_of(read_op_corpus_cases((ops / "cases.json").string())));
    }
  }
  // every case of both corpora is made before any file under its final name changes
  detail::CorpusWriter writer;
  writer.stage(dir, names, log, [&](std::size_t i) {
    return std::pair{safetensors::serialize(make(entries[i].spec)), entries[i].description};
  });
  if (have_ops) detail::stage_op_corpus(ops.string(), log, writer);
  writer.commit(log);
}

}  // namespace teo::golden
