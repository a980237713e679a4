// The router part of the mixture-of-experts ops (golden/ops/router_spec.hpp).
#include "golden/ops/router_spec.hpp"

#include <algorithm>
#include <cmath>
#include <memory>

#include "golden/routing.hpp"
#include "kernels/parallel.hpp"
#include "teo/layers/linear.hpp"
#include "teo/rng.hpp"

namespace teo::golden::ops {

namespace {

std::size_t at(index_t i) {
  return static_cast<std::size_t>(i);
}

// The amplitude of the drawn correction bias, in selection-score units: about the spread of the
// scores it is added to, so that it changes some choices.
double correction_amp(const RouterSpec& r) {
  if (r.order == RouterOrder::topk_then_score) return 0.3;  // logits
  return r.scoring == RouterScoring::sigmoid ? 0.1 : 0.5 / static_cast<double>(r.experts);
}

// How many times a token's input is redrawn before the spec is refused.
constexpr int kRedraws = 64;

}  // namespace

RouterPart read_router(Reader& r) {
  RouterPart p;
  p.tokens = r.size("tokens", 0);
  p.d_model = r.size("d_model", 1);
  RouterSpec& s = p.router;
  s.experts = r.size("num_experts", 1);
  s.top_k = r.size("num_experts_per_tok", 1);
  s.scoring = r.choice("router_scoring", {"softmax", "sigmoid"}, "softmax") == "sigmoid"
                  ? RouterScoring::sigmoid
                  : RouterScoring::softmax;
  s.order = r.choice("router_order", {"score_then_topk", "topk_then_score"}, "score_then_topk") ==
                    "topk_then_score"
                ? RouterOrder::topk_then_score
                : RouterOrder::score_then_topk;
  s.groups = r.has("router_groups") ? r.size("router_groups", 1) : 1;
  if (s.groups > 1) {
    s.topk_groups = r.size("topk_groups", 1);
    s.group_score = r.choice("group_score", {"top2_sum", "max"}, "top2_sum") == "max"
                        ? GroupScore::max
                        : GroupScore::top2_sum;
  } else {
    for (const char* k : {"topk_groups", "group_score"})
      if (r.has(k)) throw ConfigError(std::string("spec.") + k + " goes with router_groups > 1");
  }
  s.norm_topk_prob = r.flag("norm_topk_prob", false);
  s.routed_scaling_factor = r.number("routed_scaling_factor").value_or(1.0);
  try {
    s.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("spec: ") + e.what());
  }
  p.gate_bias = r.flag("router_bias", false);
  p.selection_bias = r.flag("selection_bias", false);
  p.replay = r.flag("replay_routing", false);
  p.ties = r.flag("ties", false);
  if (p.ties && s.experts < 2) throw ConfigError("spec.ties needs num_experts of at least 2");
  p.clear_margins = r.flag("clear_margins", true);
  if (!p.clear_margins && !p.replay) {
    throw ConfigError(
        "spec.clear_margins false needs replay_routing: a drawn routing near a tie is judged "
        "exactly only when it is replayed");
  }
  return p;
}

void write_router_sizes(const RouterPart& p, ojson& j) {
  j["tokens"] = p.tokens;
  j["d_model"] = p.d_model;
  j["num_experts"] = p.router.experts;
  j["num_experts_per_tok"] = p.router.top_k;
}

void write_router_options(const RouterPart& p, ojson& j) {
  const RouterSpec& s = p.router;
  j["router_scoring"] = s.scoring == RouterScoring::sigmoid ? "sigmoid" : "softmax";
  j["router_order"] =
      s.order == RouterOrder::topk_then_score ? "topk_then_score" : "score_then_topk";
  if (s.groups > 1) {
    j["router_groups"] = s.groups;
    j["topk_groups"] = s.topk_groups;
    j["group_score"] = s.group_score == GroupScore::max ? "max" : "top2_sum";
  }
  j["norm_topk_prob"] = s.norm_topk_prob;
  j["routed_scaling_factor"] = s.routed_scaling_factor;
  j["router_bias"] = p.gate_bias;
  j["selection_bias"] = p.selection_bias;
  j["replay_routing"] = p.replay;
  j["ties"] = p.ties;
  // written only when false, so that every case drawn before the key keeps its bytes
  if (!p.clear_margins) j["clear_margins"] = false;
}

void router_inputs(const RouterPart& p, OpTensors& t) {
  const index_t T = p.tokens, D = p.d_model, E = p.router.experts, k = p.router.top_k;
  const double in_d = 1.0 / std::sqrt(static_cast<double>(D));
  t.in.push_back(float_slot("input.x", {T, D}, Role::input));
  if (p.replay) t.fixed.push_back({"input.moe.topk_ids", DType::I32, {T, k}, Role::input});
  if (p.selection_bias) {
    // a parameter that chooses only: no gradient reaches it
    t.fixed.push_back(float_slot("param.gate.e_score_correction_bias", {E}, Role::param,
                                 correction_amp(p.router)));
  }
  t.in.push_back(float_slot("param.gate.weight", {E, D}, Role::param, in_d));
  if (p.gate_bias) t.in.push_back(float_slot("param.gate.bias", {E}, Role::param, in_d));
}

void router_outputs(const RouterPart& p, OpTensors& t, bool weights_grad) {
  const index_t T = p.tokens, E = p.router.experts, k = p.router.top_k;
  Slot logits = float_slot("output.logits", {T, E}, Role::output);
  logits.optional = true;
  t.out.push_back(logits);
  // the scores and margins: diagnostics a fused kernel may keep to itself
  Slot scores = float_slot("output.scores", {T, E}, Role::output);
  scores.optional = true;
  t.out.push_back(scores);
  t.out.push_back(int_output("output.topk_ids", {T, k}));
  Slot weights = float_slot("output.topk_weights", {T, k}, Role::output);
  weights.no_grad = !weights_grad;
  t.out.push_back(weights);
  Slot margin = float_slot("output.selection_margin", {T}, Role::output);
  margin.optional = true;
  t.out.push_back(margin);
}

std::optional<detail::RoutingDependence> router_dependence(const RouterPart& p,
                                                           const std::string& name) {
  using detail::RoutingDependence;
  if (name == "output.logits" || name == "output.z_loss") return RoutingDependence::none;
  if (name == "output.scores") {
    return p.router.order == RouterOrder::topk_then_score ? RoutingDependence::token_rows
                                                          : RoutingDependence::none;
  }
  if (name == "output.topk_ids" || name == "output.topk_weights" ||
      name == "output.selection_margin")
    return RoutingDependence::token_rows;
  return std::nullopt;
}

OpDef::IntBound router_int_bound(const RouterPart& p, const std::string& name) {
  if (name == "input.moe.topk_ids") return {p.router.experts, "num_experts"};
  return {};
}

void draw_router(const RouterPart& p, const OpCase& c, Values& v) {
  const index_t T = p.tokens, D = p.d_model, E = p.router.experts;
  auto& x = v.f.at("input.x");
  auto& w = v.f.at("param.gate.weight");
  std::vector<double>* b = p.gate_bias ? &v.f.at("param.gate.bias") : nullptr;
  std::vector<double>* corr =
      p.selection_bias ? &v.f.at("param.gate.e_score_correction_bias") : nullptr;
  if (p.ties) {
    std::copy_n(w.begin(), D, w.begin() + D);
    if (b) (*b)[1] = (*b)[0];
    if (corr) (*corr)[1] = (*corr)[0];
  }
  const Precision judged = c.precision.value_or(Precision::fp32);
  std::vector<int> attempts(at(T), 0);
  Routing<double> r;
  for (;;) {
    std::vector<double> logits(at(T * E));
    linear_forward(logits.data(), x.data(), w.data(), b ? b->data() : nullptr, T, D, E);
    route(p.router, logits.data(), corr ? corr->data() : nullptr, nullptr, T, r);
    if (!p.clear_margins) break;  // the draw as it is: its routing is replayed
    const auto tol = detail::routing_tolerance(p.router, x.data(), w.data(),
                                               b ? b->data() : nullptr, T, D, judged);
    bool clear = true;
    for (index_t t = 0; t < T; ++t) {
      const double m = r.margin[at(t)];
      if (m > 2 * tol[at(t)] || (p.ties && m == 0)) continue;
      clear = false;
      if (++attempts[at(t)] > kRedraws) {
        throw ConfigError("spec: token " + std::to_string(t) + "'s routing stays within the " +
                          to_string(judged) + " tolerance after " + std::to_string(kRedraws) +
                          " draws of its input (a degenerate gate): give another seed");
      }
      // the row from its own stream, as stored
      const std::string stream = "input.x.redraw." + std::to_string(attempts[at(t)]);
      std::vector<double> row(at(D));
      for (index_t i = 0; i < D; ++i) {
        row[at(i)] = 2.0 * rng::uniform01(c.seed, rng::stream_id(stream),
                                          static_cast<std::uint64_t>(t * D + i)) -
                     1.0;
      }
      as_stored(row, c);
      std::copy(row.begin(), row.end(), x.begin() + t * D);
    }
    if (clear) break;
  }
  if (p.replay) {
    auto& ids = v.i64.at("input.moe.topk_ids");
    ids.assign(r.ids.begin(), r.ids.end());
  }
}

template <class Real>
std::vector<std::int32_t> replayed_ids(const RouterPart& p, const RunContext<Real>& c) {
  const index_t T = p.tokens, k = p.router.top_k;
  if (!c.routing && !p.replay) return {};
  const auto& given = c.routing ? *c.routing : ints_of(c.v.i64, "input.moe.topk_ids", T * k);
  if (static_cast<index_t>(given.size()) != T * k) {
    throw FormatError("the routing to replay has " + std::to_string(given.size()) +
                      " ids, expected " + std::to_string(T * k));
  }
  return {given.begin(), given.end()};
}

template <class Real>
RouterRun<Real> router_forward(const RouterPart& p, RunContext<Real>& c, const Tensor<Real>& x) {
  const index_t T = p.tokens, D = p.d_model, E = p.router.experts;
  std::optional<teo::detail::EmulationScope> gate;
  if (teo::detail::emulation() == Precision::fp8) gate.emplace(Precision::bf16);
  RouterRun<Real> run;
  run.logits = c.zeros("output.logits");
  const auto w = c.in("param.gate.weight");
  const Tensor<Real> b = p.gate_bias ? c.in("param.gate.bias") : Tensor<Real>();
  linear_forward(run.logits.data(), x.data(), w.data(), p.gate_bias ? b.data() : nullptr, T, D, E);
  store(run.logits, c.p, "output.logits");
  const Tensor<Real> corr =
      p.selection_bias ? c.in("param.gate.e_score_correction_bias") : Tensor<Real>();
  const std::vector<std::int32_t> replay = replayed_ids(p, c);
  route(p.router, run.logits.data(), p.selection_bias ? corr.data() : nullptr,
        replay.empty() ? nullptr : replay.data(), T, run.routing);
  return run;
}

template <class Real>
void write_routing(const RouterPart&, RunContext<Real>& c, const RouterRun<Real>& run) {
  const auto put = [&](const char* name, const auto& values) {
    Tensor<Real>& t = c.r.at(name);
    std::copy(values.begin(), values.end(), t.data());
  };
  c.r.at("output.logits") = run.logits;
  put("output.scores", run.routing.scores);
  c.done("output.scores");
  put("output.topk_ids", run.routing.ids);
  put("output.topk_weights", run.routing.weights);
  c.done("output.topk_weights");
  put("output.selection_margin", run.routing.margin);
  c.done("output.selection_margin");
}

template <class Real>
void router_backward(const RouterPart& p, RunContext<Real>& c, const Tensor<Real>& x,
                     const RouterRun<Real>& run, const std::vector<Real>& dweights, Real aux_grad,
                     Real z_grad, Real* dx) {
  const index_t T = p.tokens, D = p.d_model, E = p.router.experts, k = p.router.top_k;
  std::optional<teo::detail::EmulationScope> gate;
  if (teo::detail::emulation() == Precision::fp8) gate.emplace(Precision::bf16);
  Tensor<Real> dlogits({T, E});
  route_backward(p.router, run.routing, dweights.data(), T, dlogits.data());
  if (aux_grad != Real(0)) {
    load_balancing_loss_backward(run.logits.data(), run.routing.ids.data(), T, E, k, aux_grad,
                                 dlogits.data());
  }
  if (z_grad != Real(0)) router_z_loss_backward(run.logits.data(), T, E, z_grad, dlogits.data());
  store(dlogits, c.p, "the gradient of output.logits");
  const auto w = c.in("param.gate.weight");
  linear_backward(dx, c.r.at("grad.param.gate.weight").data(),
                  p.gate_bias ? c.r.at("grad.param.gate.bias").data() : nullptr, dlogits.data(),
                  x.data(), w.data(), T, D, E, GradWrite::accumulate);
}

#define TEO_ROUTER(Real)                                                                           \
  template std::vector<std::int32_t> replayed_ids<Real>(const RouterPart&,                         \
                                                        const RunContext<Real>&);                  \
  template RouterRun<Real> router_forward<Real>(const RouterPart&, RunContext<Real>&,              \
                                                const Tensor<Real>&);                              \
  template void write_routing<Real>(const RouterPart&, RunContext<Real>&, const RouterRun<Real>&); \
  template void router_backward<Real>(const RouterPart&, RunContext<Real>&, const Tensor<Real>&,   \
                                      const RouterRun<Real>&, const std::vector<Real>&, Real,      \
                                      Real, Real*);
TEO_ROUTER(float)
TEO_ROUTER(double)
#undef TEO_ROUTER

}  // namespace teo::golden::ops

namespace teo::golden::detail {

std::optional<RoutedCase> routed_case(const safetensors::File& golden) {
  if (!is_op_file(golden)) return std::nullopt;
  const OpCase c = op_case_of(golden);
  using ops::RouterPart;
  using ops::Spec;
  auto s = std::make_shared<const Spec>(ops::spec_of(c));
  if (!s->def->router_of) return std::nullopt;
  const RouterPart& p = *s->def->router_of(*s);
  RoutedCase r;
  r.router = p.router;
  r.tokens = p.tokens;
  r.d_model = p.d_model;
  r.replayed = p.replay;
  const auto dep = s->def->routing_dependence;
  r.dependence = [s, dep](const std::string& name) { return dep(*s, name); };
  return r;
}

}  // namespace teo::golden::detail
