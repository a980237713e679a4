// The rules the generator and the checker share: the truth and scale of a tensor, and what makes
// a case ill-conditioned (golden_internal.hpp).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <sstream>

#include "golden_internal.hpp"
#include "teo/golden_ops.hpp"

namespace teo::golden::detail {

using safetensors::DType;
using safetensors::File;

std::vector<double> truth_of(const File& golden, const safetensors::Tensor& g, bool f32) {
  if (!f32) return g.float_values();
  const auto* rt = golden.find("ref64." + g.name);
  if (!rt || rt->dtype != DType::F64 || rt->shape != g.shape) {
    throw FormatError("the float32 golden has no float64 ref64." + g.name + " of shape " +
                      g.shape_str());
  }
  auto v = rt->values<double>();
  safetensors::release(*rt);
  return v;
}

double scale_of(const File& golden, const std::string& name, const std::vector<double>& truth,
                bool f32) {
  // A tensor's scale is its own truth's largest magnitude; a bias gradient's too. (A bias gradient
  // once borrowed its weight gradient's, which sums the same output gradients weighted by the
  // inputs: with fp8's outlier inputs at 100 times the rest, a bound from that scale was larger
  // than the whole truth.) The key bias gradient is 0 in exact arithmetic (softmax ignores a
  // per-row shift) and holds nothing but rounding noise: its scale is that of the sums it is made
  // of, which its weight gradient's bounds from below.
  double scale = 0;
  if (name.starts_with("grad.") && name.ends_with(".bias") && noise_terms(golden, name) > 0) {
    const std::string w = name.substr(0, name.size() - 4) + "weight";
    if (const auto* wt = golden.find(f32 ? "ref64." + w : w)) {
      for (double x : wt->float_values())
        if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
      safetensors::release(*wt);
    }
  }
  for (double x : truth)
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  // A truth that is exactly 0 everywhere would make every bound 0, which no backend that rounds
  // differently can meet: its scale is its inputs' instead.
  if (scale == 0 && !truth.empty()) scale = inputs_scale(golden);
  return scale;
}

double inputs_scale(const File& golden) {
  // What every computed tensor is formed from: an op case's float inputs, parameters and upstream
  // gradients; a model case's parameters.
  const bool op = is_op_file(golden);
  double scale = 0;
  for (const auto& t : golden.tensors) {
    const bool input = op ? t.name.starts_with("input.") || t.name.starts_with("param.") ||
                                t.name.starts_with("grad.output.")
                          : t.name.starts_with("param.");
    if (!input || !safetensors::is_float(t.dtype)) continue;
    for (double x : t.float_values())
      if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
    safetensors::release(t);
  }
  return scale;
}

std::int64_t noise_terms(const File& golden, const std::string& name) {
  if (!name.starts_with("grad.") || !name.ends_with(".k.bias")) return 0;
  if (is_op_file(golden)) {
    const OpCase c = op_case_of(golden);
    const auto size = [&](const char* key) {
      return c.spec.contains(key) ? c.spec.at(key).get<std::int64_t>() : std::int64_t{0};
    };
    // the decoder layer: masked self-attention over its own rows, cross-attention over the
    // memory's (no positions, sinks or softcap: a key bias is pure noise in both)
    if (c.op == "decoder_layer") {
      if (name == "grad.param.self_attn.k.bias") return size("batch") * size("seq_len");
      if (name == "grad.param.cross_attn.k.bias") return size("batch") * size("memory_len");
      return 0;
    }
    if (name != "grad.param.attn.k.bias") return 0;
    // the layer's attention options, as its spec spells them
    ModelConfig layer;
    layer.embeddings.positional =
        c.spec.value("positional", "none") == "rope" ? Positional::rope : Positional::none;
    layer.attention.attn_sinks = c.spec.value("attn_sinks", false);
    if (c.spec.contains("attn_logit_softcap") && !c.spec.at("attn_logit_softcap").is_null())
      layer.attention.attn_logit_softcap = c.spec.at("attn_logit_softcap").get<double>();
    if (!contract::noise_only("grad.layers.0.attn.k.bias", layer)) return 0;
    return size("batch") * size("seq_len");
  }
  const Case c = case_of(golden);
  if (!contract::noise_only(name, c.config)) return 0;
  // the key rows each sum runs over: an encoder_decoder's self-attention keys are the target's,
  // its cross-attention keys the source's (seq_len)
  if (name.starts_with("grad.decoder.") && name.ends_with(".self_attn.k.bias"))
    return c.batch * c.tgt_len;
  return c.batch * c.seq_len;
}

double noise_bound(std::int64_t n, bool fp64, double scale) {
  const double u = fp64 ? DBL_EPSILON / 2 : FLT_EPSILON / 2;
  return std::min(static_cast<double>(n) * u, kNoiseCap) * scale;
}

void release_judged(const File& golden, const safetensors::Tensor& g) {
  safetensors::release(g);
  for (const char* prefix : {"", "ref64."}) {
    if (const auto* t = golden.find(prefix + g.name); t && t != &g) safetensors::release(*t);
    if (g.name.starts_with("grad.") && g.name.ends_with(".bias")) {
      const std::string w = g.name.substr(0, g.name.size() - 4) + "weight";
      if (const auto* t = golden.find(prefix + w)) safetensors::release(*t);
    }
  }
}

double max_abs_diff(const std::vector<double>& x, const std::vector<double>& truth) {
  double m = 0;
  for (std::size_t i = 0; i < x.size() && i < truth.size(); ++i) {
    if (!std::isfinite(truth[i])) continue;
    if (!std::isfinite(x[i])) return INFINITY;  // NaN or inf where the truth is finite
    m = std::max(m, std::abs(x[i] - truth[i]));
  }
  return m;
}

bool is_judged(const std::string& name, bool op_case) {
  if (op_case) {
    // act.*: an op's intermediates (the moe op's grouped layout), judged as outputs
    return name.starts_with("output.") || name.starts_with("act.") ||
           name.starts_with("grad.input.") || name.starts_with("grad.param.");
  }
  return name.starts_with("act.") || name.starts_with("grad.");
}

double conditioning_limit(const File& f) {
  const index_t L =
      is_op_file(f) ? longest_reduction(op_case_of(f)) : longest_reduction(case_of(f));
  return kIllConditioned * FLT_EPSILON * std::sqrt(static_cast<double>(std::max<index_t>(L, 1)));
}

std::string float32_conditioning(const File& f, index_t L,
                                 const std::function<std::string()>& cause, bool allow) {
  const bool op = is_op_file(f);
  const double limit = kIllConditioned * FLT_EPSILON * std::sqrt(static_cast<double>(L));
  for (const auto& t : f.tensors) {
    // an integer result (the experts a router chose) is exact: the draw keeps it so
    if (!is_judged(t.name, op) || !safetensors::is_float(t.dtype)) continue;
    const auto truth = truth_of(f, t, true);
    const double scale = scale_of(f, t.name, truth, true);
    const double err = max_abs_diff(t.float_values(), truth);
    release_judged(f, t);
    if (err <= limit * scale) continue;
    std::ostringstream msg;
    msg << "the float32 case is ill-conditioned at " << stage_name(t.name) << ": its error against "
        << "float64 is " << err / scale << " of the tensor's scale, above " << limit
        << " (16 FLT_EPSILON sqrt(" << L << ")); cause: " << cause();
    if (!allow) throw IllConditioned(msg.str() + " (--allow-ill-conditioned writes it anyway)");
    return msg.str();
  }
  return "";
}

void precision_conditioning(const File& f, const std::map<std::string, std::vector<double>>& emu,
                            Precision p, const ModelConfig* cfg) {
  const bool op = is_op_file(f);
  const std::string top = cfg ? pooled_input_name(*cfg) : "";
  for (const auto& t : f.tensors) {
    if (!is_judged(t.name, op) || !safetensors::is_float(t.dtype)) continue;
    const auto truth = truth_of(f, t, true);
    const double scale = scale_of(f, t.name, truth, true);
    const auto e = emu.find(t.name);
    if (e == emu.end()) throw FormatError("the emulated run has no " + t.name);
    const double err = max_abs_diff(e->second, truth);
    release_judged(f, t);
    if (err > vacuous_limit(p) * scale) {
      throw IllConditioned("the " + std::string(to_string(p)) + " budget is vacuous at " +
                           stage_name(t.name) + ": the emulated error is " +
                           std::to_string(err / scale) + " of the tensor's scale");
    }
    if (cfg && t.name == top && cfg->head.pooling == Pooling::max) {
      const std::string where = ambiguous_pooling(f, *cfg, truth, e->second);
      if (!where.empty()) {
        throw IllConditioned("the " + std::string(to_string(p)) +
                             " budget does not resolve the max-pooling argmax of " + where);
      }
    }
  }
}

std::string pooled_input_name(const ModelConfig& cfg) {
  if (cfg.norms.norm_first) return "act.final_norm";
  if (cfg.num_layers == 0) return "act.input";
  return "act.layers." + std::to_string(cfg.num_layers - 1) + ".output";
}

bool behind_pooling_argmax(const std::string& name) {
  if (!name.starts_with("grad.")) return false;
  return name != "grad.act.loss" && name != "grad.act.logits" && name != "grad.act.pooled" &&
         !name.starts_with("grad.head.");
}

namespace {

std::string num(double v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

// (batch, seq_len, d_model) and the lengths of the golden's batch.
struct BatchDims {
  index_t B = 0, S = 0, D = 0;
  std::vector<std::int64_t> lengths;
};

BatchDims batch_dims(const File& golden, const ModelConfig& cfg) {
  const auto* lt = golden.find("input.lengths");
  const auto* tt = golden.find("input.tokens");
  if (cfg.patches_input() && lt && lt->dtype == DType::I64 && lt->shape.size() == 1) {
    // images: no tokens; the sequence is [CLS] and the patches
    return {lt->shape[0], 1 + cfg.patches(), cfg.d_model, lt->values<std::int64_t>()};
  }
  if (!lt || !tt || lt->dtype != DType::I64 || tt->shape.size() != 2) {
    throw FormatError("the golden has no input.lengths and input.tokens of the contract's shapes");
  }
  return {tt->shape[0], tt->shape[1], cfg.d_model, lt->values<std::int64_t>()};
}

// argmax over the real positions of column (b, d) of a (B, S, D) tensor; -1 when there are none.
index_t column_argmax(const std::vector<double>& v, const BatchDims& d, index_t b, index_t c) {
  index_t best = -1;
  for (index_t s = 0; s < d.lengths[static_cast<std::size_t>(b)]; ++s) {
    const double x = v[static_cast<std::size_t>((b * d.S + s) * d.D + c)];
    if (best < 0 || x > v[static_cast<std::size_t>((b * d.S + best) * d.D + c)]) best = s;
  }
  return best;
}

}  // namespace

std::string ambiguous_pooling(const File& golden, const ModelConfig& cfg,
                              const std::vector<double>& top, const std::vector<double>& emulated) {
  if (cfg.head.pooling != Pooling::max) return "";
  const BatchDims d = batch_dims(golden, cfg);
  for (index_t b = 0; b < d.B; ++b) {
    for (index_t c = 0; c < d.D; ++c) {
      double first = -INFINITY, second = -INFINITY;
      std::size_t at1 = 0, at2 = 0;
      for (index_t s = 0; s < d.lengths[static_cast<std::size_t>(b)]; ++s) {
        const auto i = static_cast<std::size_t>((b * d.S + s) * d.D + c);
        if (top[i] > first) {
          second = first;
          at2 = at1;
          first = top[i];
          at1 = i;
        } else if (top[i] > second) {
          second = top[i];
          at2 = i;
        }
      }
      if (!std::isfinite(second)) continue;
      const double noise = std::abs(emulated[at1] - top[at1]) + std::abs(emulated[at2] - top[at2]);
      if (!(first - second > 2 * noise)) {  // a NaN noise resolves nothing
        return "column (" + std::to_string(b) + ", " + std::to_string(c) + "): values " +
               num(first) + " and " + num(second);
      }
    }
  }
  return "";
}

std::string ill_conditioning_cause(const File& golden, const ModelConfig& cfg) {
  const BatchDims d = batch_dims(golden, cfg);
  if (cfg.head.pooling == Pooling::max) {
    const std::string top = pooled_input_name(cfg);
    const auto* g = golden.find(top);
    const auto* r = golden.find("ref64." + top);
    if (g && r) {
      const auto gv = g->float_values(), rv = r->float_values();
      for (index_t b = 0; b < d.B; ++b)
        for (index_t c = 0; c < d.D; ++c)
          if (column_argmax(gv, d, b, c) != column_argmax(rv, d, b, c)) {
            return "a tie in max pooling: the float32 and float64 argmax of column (" +
                   std::to_string(b) + ", " + std::to_string(c) + ") differ";
          }
    }
  }
  if (cfg.ffn.activation == Activation::relu) {
    for (index_t i = 0; i < cfg.num_layers; ++i) {
      const std::string h = "act.layers." + std::to_string(i) + ".ffn_hidden";
      const auto* g = golden.find(h);
      const auto* r = golden.find("ref64." + h);
      if (!g || !r) continue;
      const auto gv = g->float_values(), rv = r->float_values();
      for (std::size_t k = 0; k < gv.size(); ++k)
        if ((gv[k] > 0) != (rv[k] > 0)) {
          return "a ReLU kink: layer " + std::to_string(i) +
                 "'s FFN input changes sign between float32 and float64 at element " +
                 std::to_string(k);
        }
    }
  }
  return "no pooling tie or ReLU kink found (cancellation)";
}

}  // namespace teo::golden::detail
