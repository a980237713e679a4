#include "teo/golden.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "golden/check_routing.hpp"
#include "golden_internal.hpp"
#include "teo/golden_ops.hpp"
#include "teo/names.hpp"
#include "teo/suggest.hpp"

namespace teo::golden {

using nlohmann::json;
using safetensors::DType;
using safetensors::File;

std::string stage_name(const std::string& n) {
  if (n.starts_with("act.")) return n.substr(4);
  return n;
}

namespace detail {

std::string index_str(std::int64_t flat, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = shape[d] ? flat % shape[d] : 0;
    flat = shape[d] ? flat / shape[d] : 0;
  }
  std::string s = "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? "," : "") + std::to_string(idx[d]);
  return s + "]";
}

}  // namespace detail

namespace {

using detail::index_str;

using detail::full_digits;

bool same_nonfinite(double g, double c) {
  if (std::isnan(g)) return std::isnan(c);
  return g == c;  // +-inf must match exactly
}

// What to do about a candidate dtype the plain check cannot read.
std::string dtype_hint(DType candidate, DType golden) {
  if (candidate == DType::F32 && golden == DType::F64) {
    return "; a float32 candidate is judged against a float64 golden with --precision fp32 "
           "(precision=\"fp32\" in Python), or checked against the float32 case";
  }
  if (candidate == DType::F64 && golden == DType::F32)
    return "; a float64 candidate is checked against the float64 case";
  return "";
}

// The checks both rules share: a missing tensor is not checked; a dtype the rule cannot read
// (any_float: any float dtype; else exactly the golden's) or another shape fails. Returns true
// when r is already decided.
bool decided_before_values(TensorResult& r, const safetensors::Tensor& g,
                           const safetensors::Tensor* c, bool any_float) {
  r.name = g.name;
  if (!c) {
    r.status = Status::not_checked;
    r.message = "not in the candidate";
    return true;
  }
  if (any_float ? !safetensors::is_float(c->dtype) : c->dtype != g.dtype) {
    r.status = Status::fail;
    r.mismatch =
        std::string("dtype ") + safetensors::dtype_name(c->dtype) +
        (any_float ? " (not a float)" : std::string(" vs ") + safetensors::dtype_name(g.dtype));
    r.message =
        any_float
            ? std::string("dtype ") + safetensors::dtype_name(c->dtype) + " is not a float type"
            : std::string("dtype mismatch: candidate ") + safetensors::dtype_name(c->dtype) +
                  ", golden " + safetensors::dtype_name(g.dtype) + dtype_hint(c->dtype, g.dtype);
    return true;
  }
  if (c->shape != g.shape) {
    r.status = Status::fail;
    r.message = "shape mismatch: candidate " + c->shape_str() + ", golden " + g.shape_str();
    r.mismatch = r.message;
    return true;
  }
  return false;
}

// The largest finite |truth|; 0 when every finite entry is 0.
double max_magnitude(const std::vector<double>& truth) {
  double m = 0;
  for (double x : truth)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

// A bound no smaller than the truth it judges passes a zero candidate: such a tensor is not
// judged (vacuous), never passed. A noise-only tensor (the key bias gradient, 0 in exact
// arithmetic) and a truth exactly 0 keep their own rules: there a zero is the right answer.
// `what` names the bound in the message. Returns whether r was made vacuous.
bool vacuous_bound(TensorResult& r, double bound, double max_truth, bool noise_only,
                   const char* what = "bound") {
  if (noise_only || !(max_truth > 0) || bound < max_truth) return false;
  r.status = Status::vacuous;
  r.message = std::string(what) + " vacuous: the " + what + " " + full_digits(bound) +
              " is at least the truth's largest magnitude " + full_digits(max_truth) +
              ", so a zero would pass";
  return true;
}

TensorResult check_tensor(const File& golden, const safetensors::Tensor& g,
                          const safetensors::Tensor* c, bool f32, const CheckOptions& opts,
                          double ill_conditioned_limit) {
  TensorResult r;
  if (decided_before_values(r, g, c, /*any_float=*/false)) return r;
  r.compared = true;
  // Each mapped tensor's pages go back as soon as its values are copied out: at most one is
  // resident at a time.
  const auto gv = g.float_values();
  safetensors::release(g);
  const auto cv = c->float_values();
  safetensors::release(*c);
  std::vector<double> ref64;
  if (f32) ref64 = detail::truth_of(golden, g, true);
  const std::vector<double>& ref = f32 ? ref64 : gv;
  const double scale = detail::scale_of(golden, g.name, ref, f32);
  double max_ref = 0, teo_err = 0, max_abs = 0;
  std::int64_t worst = -1, nonfinite_at = -1, nonfinite_count = 0;
  for (std::size_t i = 0; i < gv.size(); ++i) {
    if (!std::isfinite(gv[i]) || !std::isfinite(ref[i]) || !std::isfinite(cv[i])) {
      if (!same_nonfinite(gv[i], cv[i]) || std::isfinite(gv[i]) != std::isfinite(cv[i])) {
        if (nonfinite_at < 0) nonfinite_at = static_cast<std::int64_t>(i);
        ++nonfinite_count;
      }
      continue;
    }
    max_ref = std::max(max_ref, std::abs(ref[i]));
    teo_err = std::max(teo_err, std::abs(gv[i] - ref[i]));
    const double e = std::abs(cv[i] - ref[i]);
    if (e > max_abs || worst < 0) {
      if (e > max_abs) max_abs = e;
      worst = static_cast<std::int64_t>(i);
    }
  }
  r.max_abs = max_abs;
  r.max_rel = max_ref > 0 ? max_abs / max_ref : (max_abs > 0 ? INFINITY : 0);
  r.bound =
      f32 ? opts.k * teo_err + opts.floor_eps * FLT_EPSILON * scale : opts.rtol * scale + opts.atol;
  // A tensor of pure rounding noise: any order of summation of its n terms is right.
  const auto n = detail::noise_terms(golden, g.name);
  if (n) r.bound = std::max(r.bound, detail::noise_bound(n, !f32, scale));
  r.ratio = r.bound > 0 ? max_abs / r.bound : (max_abs > 0 ? INFINITY : 0);
  if (nonfinite_count > 0) {
    const auto i = static_cast<std::size_t>(nonfinite_at);
    r.status = Status::fail;
    r.message = std::to_string(nonfinite_count) + " NaN/Inf mismatch(es), first at " +
                index_str(nonfinite_at, g.shape) + ": candidate " + full_digits(cv[i]) +
                ", golden " + full_digits(gv[i]);
    return r;
  }
  // teo's own float32 run is off its float64 truth by more than generation allows (a golden
  // written with --allow-ill-conditioned): its error says nothing about a candidate's.
  if (f32 && teo_err > ill_conditioned_limit * scale) {
    r.status = Status::vacuous;
    r.message = "ill-conditioned: teo's own float32 error is " + full_digits(teo_err / scale) +
                " of the scale, above the " + full_digits(ill_conditioned_limit) +
                " generation allows (the golden was written with --allow-ill-conditioned)";
    return r;
  }
  if (vacuous_bound(r, r.bound, max_magnitude(ref), n > 0)) return r;
  r.status = max_abs <= r.bound ? Status::pass : Status::fail;
  if (r.status == Status::fail && worst >= 0) {
    const auto i = static_cast<std::size_t>(worst);
    r.message = "worst at " + index_str(worst, g.shape) + ": candidate " + full_digits(cv[i]) +
                ", reference " + full_digits(ref[i]);
  }
  return r;
}

// One step of bf16 (fp8's storage format) at |x|: 2^(e - 8) for |x| in [2^(e-1), 2^e).
double bf16_step(double x) {
  int e = 0;
  std::frexp(x, &e);
  return x == 0 ? 0 : std::ldexp(1.0, std::max(e - 8, -133));
}

// What the fp8 recipe rule allows beyond one bf16 step: fp8_recipe_k of the emulated error, plus
// float32 accumulation's 16 * 2^-24 of the scale.
double recipe_allowance(const CheckOptions& opts, double emu_err, double scale) {
  return opts.fp8_recipe_k * emu_err + 16 * std::ldexp(1.0, -24) * scale;
}

// Under fp8, a tensor within its budget still fails when it is off the emulated run by more than
// opts.fp8_recipe_k of the emulated error (CheckOptions::fp8_recipe_k), where the rule `decides`;
// elsewhere the distance is only reported. Each element's distance
// beyond one bf16 step counts: a backend whose float32 sums run in another order may store the
// neighbouring bf16 of any value.
void judge_recipe(TensorResult& r, const std::vector<double>& cv, const std::vector<double>& emu,
                  double emu_err, double scale, const CheckOptions& opts,
                  const std::vector<std::int64_t>& shape, bool decides) {
  double dist = 0;
  std::int64_t at = -1;
  for (std::size_t i = 0; i < cv.size(); ++i) {
    if (!std::isfinite(cv[i]) || !std::isfinite(emu[i])) continue;
    const double d =
        std::abs(cv[i] - emu[i]) - bf16_step(std::max(std::abs(cv[i]), std::abs(emu[i])));
    if (d > dist) {
      dist = d;
      at = static_cast<std::int64_t>(i);
    }
  }
  r.recipe_distance = emu_err > 0 ? dist / emu_err : 0;
  if (!decides || std::isinf(opts.fp8_recipe_k) || at < 0) return;
  const double allowed = recipe_allowance(opts, emu_err, scale);
  if (!(dist > allowed)) return;
  const auto i = static_cast<std::size_t>(at);
  r.status = Status::fail;
  r.message = "off the fp8 recipe: |candidate - emulated| beyond one bf16 step is " +
              full_digits(r.recipe_distance) + " of the emulated error (allowed " +
              full_digits(opts.fp8_recipe_k) + "), at " + index_str(at, shape) + ": candidate " +
              full_digits(cv[i]) + ", emulated " + full_digits(emu[i]);
}

// One tensor under a reduced precision p: err(candidate) <= k * err(emulated) + floor * u * scale
// against the float64 truth; vacuous when the emulated error exceeds vacuous_limit(p, recipe_rule)
// of the scale
// or `behind_tie` (the tensor depends on a max-pooling argmax the budget does not resolve) is set.
TensorResult judge_budget(const File& golden, const safetensors::Tensor& g,
                          const safetensors::Tensor* c, bool f32, const std::vector<double>& emu,
                          Precision p, const CheckOptions& opts, const std::string& behind_tie,
                          bool recipe_rule) {
  TensorResult r;
  if (decided_before_values(r, g, c, /*any_float=*/true)) return r;
  r.compared = true;
  const auto truth = detail::truth_of(golden, g, f32);
  safetensors::release(g);
  const auto cv = c->float_values();
  safetensors::release(*c);
  const double scale = detail::scale_of(golden, g.name, truth, f32);
  double max_abs = 0;
  std::int64_t worst = -1, nonfinite_at = -1, nonfinite_count = 0;
  for (std::size_t i = 0; i < truth.size(); ++i) {
    if (!std::isfinite(truth[i]) || !std::isfinite(cv[i])) {
      if (!same_nonfinite(truth[i], cv[i])) {
        if (nonfinite_at < 0) nonfinite_at = static_cast<std::int64_t>(i);
        ++nonfinite_count;
      }
      continue;
    }
    const double e = std::abs(cv[i] - truth[i]);
    if (e > max_abs || worst < 0) {
      max_abs = std::max(max_abs, e);
      worst = static_cast<std::int64_t>(i);
    }
  }
  const double emu_err = detail::max_abs_diff(emu, truth);
  r.max_abs = max_abs;
  r.max_rel = scale > 0 ? max_abs / scale : (max_abs > 0 ? INFINITY : 0);
  r.emulated_err = scale > 0 ? emu_err / scale : 0;
  // The floor is in units of the storage format's u: bf16's for fp8, whose emulated error is
  // already its quantization's.
  r.bound = opts.budget_k * emu_err + opts.budget_floor * unit_roundoff(storage_format(p)) * scale;
  const auto n = detail::noise_terms(golden, g.name);
  if (n) r.bound = std::max(r.bound, detail::noise_bound(n, p == Precision::fp64, scale));
  r.ratio = r.bound > 0 ? max_abs / r.bound : (max_abs > 0 ? INFINITY : 0);
  if (nonfinite_count > 0) {
    const auto i = static_cast<std::size_t>(nonfinite_at);
    r.status = Status::fail;
    r.message = std::to_string(nonfinite_count) + " NaN/Inf mismatch(es), first at " +
                index_str(nonfinite_at, g.shape) + ": candidate " + full_digits(cv[i]) +
                ", truth " + full_digits(truth[i]);
    return r;
  }
  if (emu_err > detail::vacuous_limit(p, recipe_rule) * scale || !behind_tie.empty()) {
    r.status = Status::vacuous;
    r.message = !behind_tie.empty()
                    ? "budget vacuous: behind the max-pooling argmax of " + behind_tie +
                          ", which the " + to_string(p) + " budget does not resolve"
                    : "budget vacuous: the emulated " + std::string(to_string(p)) + " error is " +
                          full_digits(r.emulated_err) + " of the scale";
    return r;
  }
  // Where the fp8 recipe rule decides it judges too: a zero is off the recipe unless the rule's
  // own allowance reaches the truth, so that allowance, not the budget, must stay below it.
  const bool recipe_decides =
      p == Precision::fp8 && recipe_rule && std::isfinite(opts.fp8_recipe_k);
  const double max_truth = max_magnitude(truth);
  const double judging =
      recipe_decides ? recipe_allowance(opts, emu_err, scale) + bf16_step(max_truth) : r.bound;
  if (vacuous_bound(r, judging, max_truth, n > 0, recipe_decides ? "recipe allowance" : "bound")) {
    return r;
  }
  r.status = max_abs <= r.bound ? Status::pass : Status::fail;
  if (r.status == Status::fail && worst >= 0) {
    const auto i = static_cast<std::size_t>(worst);
    r.message = "worst at " + index_str(worst, g.shape) + ": candidate " + full_digits(cv[i]) +
                ", truth " + full_digits(truth[i]) + ", emulated " + full_digits(emu[i]);
    return r;
  }
  if (p == Precision::fp8) judge_recipe(r, cv, emu, emu_err, scale, opts, g.shape, recipe_rule);
  return r;
}

bool wanted(const std::string& name, Only only, bool op) {
  if (!detail::is_judged(name, op)) return false;
  const bool fwd =
      op ? name.starts_with("output.") || name.starts_with("act.") : name.starts_with("act.");
  if (only == Only::forward) return fwd;
  if (only == Only::backward) return !fwd;
  return true;
}

// Throws FormatError when `golden` is neither a teo golden nor an op case; returns whether it is
// a float32 case.
bool golden_is_f32(const File& golden) {
  const std::string* fmt = golden.meta("format");
  if (!fmt || (*fmt != kFormat && *fmt != kOpFormat)) {
    throw FormatError(std::string("not a teo golden file: __metadata__.format is ") +
                      (fmt ? "\"" + *fmt + "\"" : "missing") + ", expected \"" + kFormat +
                      "\" or \"" + kOpFormat + "\"");
  }
  if (*fmt == kOpFormat) return op_case_of(golden).dtype == "float32";
  const std::string* cs = golden.meta("case");
  if (!cs) throw FormatError("the golden has no __metadata__.case");
  json cj;
  try {
    cj = json::parse(*cs);
  } catch (const json::exception&) {
    throw FormatError("the golden's __metadata__.case is not valid JSON");
  }
  if (!cj.is_object() || !cj.contains("dtype") || !cj["dtype"].is_string()) {
    throw FormatError("the golden's __metadata__.case has no dtype");
  }
  const auto d = cj["dtype"].get<std::string>();
  if (d != "float32" && d != "float64") throw FormatError("the golden's dtype is " + d);
  return d == "float32";
}

// An op case's optional outputs (attention's scores and probs); none for a model case.
std::set<std::string> optional_outputs_of(const File& golden, bool op) {
  std::set<std::string> out;
  if (!op) return out;
  for (const auto& t : op_contract(op_case_of(golden)))
    if (t.optional) out.insert(t.name);
  return out;
}

CaseReport not_checked_report(const File& golden, const CheckOptions& opts,
                              const std::string& why) {
  validate(golden);
  golden_is_f32(golden);
  const bool op = is_op_file(golden);
  const std::set<std::string> optional = optional_outputs_of(golden, op);
  CaseReport rep;
  for (const auto& t : golden.tensors) {
    if (!wanted(t.name, opts.only, op)) continue;
    if (optional.contains(t.name)) {
      rep.optional_missing.push_back(t.name);
      continue;
    }
    TensorResult r;
    r.name = t.name;
    r.message = why;
    rep.tensors.push_back(r);
    ++rep.not_checked;
  }
  return rep;
}

template <class Fn>
auto with_path(const std::string& path, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const FormatError& e) {
    const std::string msg = e.what();
    if (msg.starts_with(path)) throw;
    throw FormatError(path + ": " + msg);
  }
}

// The candidate's tensors the golden does not hold: computed tensors --keep left out are noted
// (CaseReport::not_in_golden); a name its contract does not know fails, with the closest golden
// name, unless opts.allow_extra.
void judge_names(const File& golden, const File& candidate, const CheckOptions& opts, bool op,
                 CaseReport& rep) {
  std::set<std::string> contract, optional;
  std::vector<std::string> names;
  for (const auto& t : candidate.tensors) {
    if (golden.find(t.name)) continue;
    if (names.empty()) {
      for (const auto& g : golden.tensors) names.push_back(g.name);
      if (golden.meta("kept")) contract = detail::contract_names(golden);
      // an optional output this case's spec turned off (probs: false, no RoPE) is the op's
      if (op) {
        for (auto& n : op_optional_outputs(op_case_of(golden).op)) optional.insert(std::move(n));
      }
    }
    if (contract.contains(t.name) || optional.contains(t.name)) {
      if (wanted(t.name, opts.only, op)) rep.not_in_golden.push_back(t.name);
      continue;
    }
    if (opts.allow_extra) {
      rep.extra.push_back(t.name);
      continue;
    }
    TensorResult r;
    r.name = t.name;
    r.status = Status::fail;
    r.mismatch = "not in the golden";
    r.suggestion = closest_match(t.name, names);
    r.message = (r.suggestion.empty() ? std::string("no golden tensor is close")
                                      : "did you mean \"" + r.suggestion + "\"?") +
                " A misspelled name passes nothing: --allow-extra (allow_extra=True in Python) "
                "accepts extra tensors";
    rep.tensors.push_back(std::move(r));
    ++rep.failed;
    ++rep.unknown;
  }
}

}  // namespace

namespace {

// The precision a golden was made for: a precision case's (tf32, bf16, fp16, fp8), else none.
std::optional<Precision> golden_precision(const File& golden) {
  return is_op_file(golden) ? op_case_of(golden).precision : case_of(golden).precision;
}

// The precision a candidate is judged in: the flag; else the golden's own precision case, unless
// the candidate's BF16, F16 or F8 tensors imply another (F8 tensors fp8, with BF16 ones as its
// storage format); else what they imply; else the golden's dtype. A flag the dtypes contradict,
// or both BF16 and F16, is a ConfigError. `note` says why, when the precision is not the golden's
// own and no flag chose it.
Precision judged_precision(const File& golden, const File& candidate, bool f32,
                           const CheckOptions& opts, std::string& note) {
  std::optional<Precision> implied;
  std::string implied_by;
  for (const auto& t : candidate.tensors) {
    const auto* g = golden.find(t.name);
    // a tensor the golden stores in fp8 itself (a quantized cache's codes) implies nothing in
    // fp8 (one in the other fp8 format fails at that tensor)
    const auto fp8 = [](DType d) { return d == DType::F8_E4M3 || d == DType::F8_E5M2; };
    if (!g || !detail::is_judged(t.name, is_op_file(golden)) || (fp8(g->dtype) && fp8(t.dtype))) {
      continue;
    }
    std::optional<Precision> p;
    if (t.dtype == DType::BF16) p = Precision::bf16;
    if (t.dtype == DType::F16) p = Precision::fp16;
    if (t.dtype == DType::F8_E4M3 || t.dtype == DType::F8_E5M2) p = Precision::fp8;
    if (!p) continue;
    const auto fp8_pair = [](Precision x, Precision y) {
      return (x == Precision::fp8 && y == Precision::bf16) ||
             (x == Precision::bf16 && y == Precision::fp8);
    };
    if (implied && fp8_pair(*implied, *p)) {
      if (*p == Precision::fp8) {
        implied = p;
        implied_by = t.name + " (" + safetensors::dtype_name(t.dtype) + ")";
      }
      continue;
    }
    if (implied && *implied != *p) {
      throw ConfigError("the candidate stores " + implied_by + " and " + t.name + " (" +
                        safetensors::dtype_name(t.dtype) +
                        "): one candidate is judged in one precision");
    }
    if (!implied) implied_by = t.name + " (" + safetensors::dtype_name(t.dtype) + ")";
    implied = p;
  }
  if (opts.precision && implied && *opts.precision != *implied &&
      storage_format(*opts.precision) != *implied) {
    throw ConfigError(std::string("--precision ") + to_string(*opts.precision) +
                      " conflicts with the candidate's " + implied_by + ", which implies " +
                      to_string(*implied));
  }
  if (opts.precision) return *opts.precision;
  const std::optional<Precision> own = golden_precision(golden);
  // a candidate in the golden's precision, or in its storage format, or upcast to float
  if (own && (!implied || *implied == *own || storage_format(*own) == *implied)) return *own;
  if (!implied) return f32 ? Precision::fp32 : Precision::fp64;
  note = std::string("judged as ") + to_string(*implied) + ", which the candidate's " + implied_by +
         " implies; the golden is " +
         (own ? std::string("a ") + to_string(*own) + " case (--precision " + to_string(*own) +
                    " judges it as one)"
              : std::string("a ") + (f32 ? "float32" : "float64") + " case with no precision");
  return *implied;
}

}  // namespace

CaseReport check(const File& golden, const File& candidate, const CheckOptions& opts) {
  validate(golden);
  if (opts.names && !is_op_file(golden)) {
    CheckOptions in_teo_names = opts;
    in_teo_names.names = nullptr;
    // A case the map does not describe (another family's, in a directory) is read under teo's
    // names: a checkpoint name in its candidate then fails as a name the golden does not have.
    std::optional<File> renamed;
    try {
      renamed = names::candidate_in_teo_names(candidate, *opts.names, case_of(golden).config);
    } catch (const ConfigError&) {
      return check(golden, candidate, in_teo_names);
    }
    return check(golden, *renamed, in_teo_names);
  }
  const bool f32 = golden_is_f32(golden);
  std::string precision_note;
  const Precision p = judged_precision(golden, candidate, f32, opts, precision_note);
  // fp64, and fp32 against a float32 golden, are the plain checks; everything else is judged
  // against the emulated run's error.
  const bool budget = p != Precision::fp64 && !(p == Precision::fp32 && f32);
  std::map<std::string, std::vector<double>> emu;
  std::string tie;
  const bool op = is_op_file(golden);
  const std::set<std::string> optional_outputs = optional_outputs_of(golden, op);
  std::set<std::string> exact_outputs;
  if (op)
    for (const auto& t : op_contract(op_case_of(golden)))
      if (t.exact) exact_outputs.insert(t.name);
  if (budget) {
    // once per case; its memory is reported, since for a large case it is most of the check's
    if (opts.progress) opts.progress("emulating the " + std::string(to_string(p)) + " run", true);
    emu = emulate(golden, p);
  }
  if (budget && !op) {
    const ModelConfig cfg = case_of(golden).config;
    const std::string top = detail::pooled_input_name(cfg);
    if (const auto* t = golden.find(top); t && cfg.head.pooling == Pooling::max) {
      tie = detail::ambiguous_pooling(golden, cfg, detail::truth_of(golden, *t, f32), emu.at(top));
    }
  }
  CaseReport rep;
  rep.precision = to_string(budget ? p : f32 ? Precision::fp32 : Precision::fp64);
  rep.budget = budget;
  if (!precision_note.empty()) rep.notes.push_back(precision_note);
  if (const std::string* ill = golden.meta("ill_conditioned")) {
    rep.notes.push_back("the golden was written with --allow-ill-conditioned (" + *ill +
                        "): its ill-conditioned tensors are not judged");
  }
  // the float32 rule: tensors on which teo's own float32 run is ill-conditioned are not judged
  const double ill_limit = f32 && !budget ? detail::conditioning_limit(golden) : 0;
  // Only in a linear op case is every fp8 operand a golden input (OpDef::fp8_operands).
  // Elsewhere a faithful backend's bf16 values upstream differ from the emulated run's by rounding
  // flips, which move its fp8 roundings (and, through an amax, a whole operand's scale) by as much
  // as a recipe bug does (docs/fp8.md, "Judging").
  rep.recipe_rule = budget && p == Precision::fp8 && op && std::isfinite(opts.fp8_recipe_k) &&
                    detail::fp8_operands_are_inputs(op_case_of(golden).op);
  for (const auto& [n, v] : emu) rep.emulated_bytes += v.size() * sizeof(double);
  // A routed case: its routing first, token by token (the emulated run replays the golden's)
  const auto routed = op ? detail::routed_case(golden) : std::nullopt;
  std::optional<detail::RoutingJudgement> routing;
  if (routed) {
    routing = detail::judge_routing(golden, candidate, *routed, f32,
                                    budget ? p
                                    : f32  ? Precision::fp32
                                           : Precision::fp64);
    rep.ambiguous_tokens = routing->ambiguous;
  }
  // A model case's routing: layer by layer, each after the layers before it
  std::optional<ModelConfig> model_cfg;
  std::optional<detail::ModelRoutingJudgement> model_routing;
  if (!op) model_cfg = case_of(golden).config;
  if (model_cfg && model_cfg->moe()) {
    model_routing = detail::judge_model_routing(golden, candidate, *model_cfg, f32,
                                                budget ? p
                                                : f32  ? Precision::fp32
                                                       : Precision::fp64,
                                                emu);
    rep.ambiguous_tokens = model_routing->ambiguous;
  }
  std::size_t judged = 0, at = 0;
  for (const auto& g : golden.tensors) judged += wanted(g.name, opts.only, op) ? 1 : 0;
  for (const auto& g : golden.tensors) {
    if (!wanted(g.name, opts.only, op)) continue;
    if (opts.progress) {
      opts.progress(g.name + " (" + std::to_string(++at) + "/" + std::to_string(judged) + ")",
                    true);
    }
    const auto* c = candidate.find(g.name);
    if (!c && optional_outputs.contains(g.name)) {
      // An output a fused kernel may omit: listed apart, never counted against the candidate.
      rep.optional_missing.push_back(g.name);
      continue;
    }
    // what ambiguous tokens contaminate: as a whole (not judged), or row by row (left out)
    auto dependence = routing && !routing->rows.empty() && c ? routed->dependence(g.name)
                                                             : detail::RoutingDependence::none;
    const auto model_ids =
        model_routing ? model_routing->ids.find(g.name) : decltype(model_routing->ids.end()){};
    const bool model_judged = model_routing && model_ids != model_routing->ids.end();
    if (model_routing && !model_judged && model_routing->first_layer >= 0 && c &&
        detail::after_routing(g.name, model_routing->first_layer, *model_cfg)) {
      dependence = detail::RoutingDependence::whole;
    }
    std::optional<safetensors::Tensor> patched;
    if (dependence == detail::RoutingDependence::token_rows && g.dtype != DType::I32 &&
        safetensors::is_float(c->dtype) && c->shape == g.shape && (budget || c->dtype == g.dtype)) {
      patched = detail::without_rows(*c, g, routing->rows, budget ? DType::F64 : c->dtype);
    }
    const safetensors::Tensor* judged_c = patched ? &*patched : c;
    if (routing && g.name == "output.topk_ids") {
      rep.tensors.push_back(routing->ids);
    } else if (model_judged) {
      rep.tensors.push_back(model_ids->second);
    } else if (exact_outputs.contains(g.name)) {
      const auto e = budget ? emu.find(g.name) : emu.end();
      if (budget && e == emu.end())
        throw FormatError("the golden's " + g.name + " is not in the contract");
      rep.tensors.push_back(detail::judge_exact(golden, g, c, f32, budget ? &e->second : nullptr));
    } else if (g.dtype == DType::I32 && dependence != detail::RoutingDependence::whole) {
      rep.tensors.push_back(detail::judge_exact_ints(g, c));
    } else if (dependence == detail::RoutingDependence::whole) {
      TensorResult r;
      r.name = g.name;
      r.status = Status::ambiguous;
      r.message = routing ? "not judged: it depends on the routing of the ambiguous token(s) " +
                                detail::tokens_str(routing->rows)
                          : "not judged: it depends on the routing of the ambiguous position(s) " +
                                detail::tokens_str(model_routing->rows) + " of layer " +
                                std::to_string(model_routing->first_layer);
      rep.tensors.push_back(r);
    } else if (budget) {
      const auto e = emu.find(g.name);
      if (e == emu.end()) throw FormatError("the golden's " + g.name + " is not in the contract");
      rep.tensors.push_back(judge_budget(golden, g, judged_c, f32, e->second, p, opts,
                                         !op && detail::behind_pooling_argmax(g.name) ? tie : "",
                                         rep.recipe_rule));
    } else {
      rep.tensors.push_back(check_tensor(golden, g, judged_c, f32, opts, ill_limit));
    }
    if (patched) {
      rep.tensors.back().excluded =
          "the rows of the ambiguous token(s) " + detail::tokens_str(routing->rows) + " left out";
    }
    detail::release_judged(golden, g);
    if (c) safetensors::release(*c);
    const auto& r = rep.tensors.back();
    if (r.status == Status::pass) ++rep.passed;
    if (r.status == Status::fail) {
      ++rep.failed;
      if (rep.first_divergence.empty()) rep.first_divergence = stage_name(r.name);
    }
    if (r.status == Status::not_checked) ++rep.not_checked;
    if (r.status == Status::vacuous) ++rep.vacuous;
    if (r.status == Status::ambiguous) ++rep.ambiguous;
  }
  judge_names(golden, candidate, opts, op, rep);
  return rep;
}

namespace {
// A golden file at least this large is a large case: its progress is worth a line off a terminal.
constexpr std::uintmax_t kLargeFile = 100'000'000;

// The .safetensors files under the candidate directory (paths relative to it) that are not among
// the golden directory's `names`; the golden directory is not searched if it lies inside.
std::vector<std::string> candidates_without_golden(const std::string& golden,
                                                   const std::string& candidate,
                                                   const std::vector<std::string>& names) {
  namespace fs = std::filesystem;
  const std::set<std::string> known(names.begin(), names.end());
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(
           candidate, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code same_ec;
    if (it->is_directory() && fs::equivalent(it->path(), golden, same_ec)) {
      it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file() && it->path().extension() == ".safetensors") {
      auto n = it->path().lexically_relative(candidate).generic_string();
      if (!known.contains(n)) out.push_back(std::move(n));
    }
  }
  if (ec) throw FileError(candidate + ": cannot list the directory: " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

std::vector<CaseReport> check_paths(const std::string& golden, const std::string& candidate,
                                    const CheckOptions& opts) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(golden, ec)) throw FileError(golden + ": no such file or directory");
  if (!fs::exists(candidate, ec)) throw FileError(candidate + ": no such file or directory");
  struct Pair {
    std::string golden, candidate, name;  // name: the golden's path within the directory
  };
  std::vector<Pair> pairs;
  std::vector<std::string> orphans;
  if (fs::is_directory(golden, ec)) {
    if (!fs::is_directory(candidate, ec)) {
      throw FileError(candidate + ": is a file, but the golden " + golden +
                      " is a directory; give a candidate directory");
    }
    // Every golden under the directory, subdirectories included (golden/ holds the model cases
    // and ops/ the op cases), matched by its path relative to it in the candidate directory: the
    // path as listed, never through a symlink's target (a golden linked from elsewhere is still
    // matched by its own name). A candidate directory inside the golden one is not a golden.
    std::vector<std::string> names;
    for (auto it = fs::recursive_directory_iterator(golden, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      std::error_code same_ec;
      if (it->is_directory() && fs::equivalent(it->path(), candidate, same_ec)) {
        it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file() && it->path().extension() == ".safetensors") {
        names.push_back(it->path().lexically_relative(golden).generic_string());
      }
    }
    if (ec) throw FileError(golden + ": cannot list the directory: " + ec.message());
    std::sort(names.begin(), names.end());
    if (names.empty()) throw FileError(golden + ": holds no .safetensors files");
    for (const auto& n : names)
      pairs.push_back({(fs::path(golden) / n).string(), (fs::path(candidate) / n).string(), n});
    orphans = candidates_without_golden(golden, candidate, names);
  } else {
    std::string c = candidate;
    if (fs::is_directory(candidate, ec))
      c = (fs::path(candidate) / fs::path(golden).filename()).string();
    pairs.push_back({golden, c, fs::path(golden).filename().string()});
  }
  std::vector<CaseReport> reports;
  for (const auto& pair : pairs) {
    const std::string &gp = pair.golden, &cp = pair.candidate;
    if (opts.progress) {
      const auto size = fs::file_size(gp, ec);
      std::ostringstream what;
      what << "checking " << gp << " (" << reports.size() + 1 << "/" << pairs.size() << ", "
           << std::fixed << std::setprecision(2) << static_cast<double>(size) / 1e9 << " GB)";
      opts.progress(what.str(), /*detail=*/ec || size < kLargeFile);
    }
    // Mapped, a file's size does not bound the check's memory: any size up to 1 TiB is read.
    const safetensors::Limits limits{.max_header_bytes = 100'000'000,
                                     .max_file_bytes = std::uint64_t{1} << 40};
    const File g = safetensors::map(gp, limits);
    CaseReport rep;
    if (!fs::exists(cp, ec)) {
      rep = with_path(gp, [&] { return not_checked_report(g, opts, "no candidate file"); });
      rep.no_candidate = true;
    } else {
      const File c = safetensors::map(cp, limits);
      rep = with_path(gp, [&] { return check(g, c, opts); });
    }
    rep.name = pair.name;
    rep.golden_path = gp;
    rep.candidate_path = cp;
    reports.push_back(std::move(rep));
  }
  std::vector<std::string> names;
  names.reserve(pairs.size());
  for (const auto& pair : pairs) names.push_back(pair.name);
  for (const auto& n : orphans) {
    CaseReport rep;
    rep.name = n;
    rep.candidate_path = (fs::path(candidate) / n).string();
    rep.no_golden = true;
    rep.accepted = opts.allow_extra;
    rep.suggestion = closest_match(n, names);
    reports.push_back(std::move(rep));
  }
  return reports;
}

}  // namespace teo::golden
