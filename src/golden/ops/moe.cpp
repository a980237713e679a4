// The moe op (docs/golden-format.md, "Op cases"): a mixture-of-experts block on T tokens: the
// router, the routed experts in the grouped layout the fused kernels use, the shared experts (a
// dense gated FFN always applied, with Qwen2-MoE's sigmoid gate), and the exact backward of all of
// it (docs/semantics.md, 19.2 and 19.3).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "golden/ops/op.hpp"
#include "golden/ops/router_spec.hpp"
#include "golden/ops/weight_format.hpp"
#include "layers/logistic.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/moe.hpp"
#include "teo/layers/shared_experts.hpp"
#include "teo/rounding.hpp"

namespace teo::golden::ops {

namespace {

std::size_t at(index_t i) {
  return static_cast<std::size_t>(i);
}

// The op's spec: the router part, the routed experts (moe: its router the part's), their biases,
// the shared experts' width (0: none) and gate, the aux losses as outputs, and forced loads.
struct MoeOpSpec {
  RouterPart router;
  MoeSpec moe;
  bool expert_bias = false;
  index_t shared_d_ff = 0;
  bool shared_gate = false;
  bool aux_losses = false;
  std::vector<std::int64_t> loads;  // expert_loads: expert e gets exactly loads[e] rows
  WeightFormat experts;             // weight_format: the routed experts' (dense by default)
};

// The routed experts' weights, each (E, rows, cols): w_gate and w_up (F, D), w_down (D, F).
struct ExpertWeight {
  const char* name;
  const char* dequant;  // the exact values' output, with a weight_format
  bool down;
};
constexpr ExpertWeight kExpertWeights[] = {
    {"param.experts.w_gate", "output.experts.w_gate_dequant", false},
    {"param.experts.w_up", "output.experts.w_up_dequant", false},
    {"param.experts.w_down", "output.experts.w_down_dequant", true}};

const MoeOpSpec& own(const Spec& s) {
  return s.as<MoeOpSpec>();
}

// Forced loads: E counts in [0, T] summing to T k, on a plain router (no groups, no correction
// bias) whose gate can single out every expert (d_model >= E).
std::vector<std::int64_t> read_loads(Reader& r, const RouterPart& p) {
  if (!r.has("expert_loads")) return {};
  r.use("expert_loads");
  const json& v = r.value("expert_loads");
  const index_t E = p.router.experts, T = p.tokens, k = p.router.top_k;
  if (!v.is_array() || static_cast<index_t>(v.size()) != E) {
    throw ConfigError("spec.expert_loads must be an array of num_experts = " + std::to_string(E) +
                      " counts");
  }
  std::vector<std::int64_t> loads;
  std::int64_t sum = 0;
  for (const auto& x : v) {
    if (!x.is_number_integer() || x.get<std::int64_t>() < 0 || x.get<std::int64_t>() > T) {
      throw ConfigError("spec.expert_loads must hold counts in [0, tokens = " + std::to_string(T) +
                        "] (a token chooses an expert once), got " + x.dump());
    }
    loads.push_back(x.get<std::int64_t>());
    sum += loads.back();
  }
  if (sum != T * k) {
    throw ConfigError("spec.expert_loads sums to " + std::to_string(sum) + ", not tokens * " +
                      "num_experts_per_tok = " + std::to_string(T * k));
  }
  if (p.router.groups > 1 || p.selection_bias || p.ties) {
    throw ConfigError(
        "spec.expert_loads goes with a plain router: no router_groups, "
        "selection_bias or ties");
  }
  if (p.d_model < E) {
    throw ConfigError(
        "spec.expert_loads needs d_model >= num_experts (the gate singles out each "
        "expert by a dimension of its own)");
  }
  return loads;
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<MoeOpSpec>();
  s.router = read_router(r);
  MoeSpec& m = s.moe;
  m.router = s.router.router;
  m.d_model = s.router.d_model;
  m.d_ff = r.size("moe_d_ff", 1);
  const bool clamped =
      r.choice("expert_kind", {"swiglu", "clamped_swiglu"}, "swiglu") == "clamped_swiglu";
  m.kind = clamped ? ExpertKind::clamped_swiglu : ExpertKind::swiglu;
  if (clamped) {
    m.alpha = r.number("swiglu_alpha").value_or(1.702);
    m.limit = r.number("swiglu_limit").value_or(7.0);
  } else {
    for (const char* k : {"swiglu_alpha", "swiglu_limit"}) {
      if (r.has(k))
        throw ConfigError(std::string("spec.") + k + " goes with expert_kind \"clamped_swiglu\"");
    }
  }
  s.expert_bias = r.flag("expert_bias", false);
  m.weight_at_input = r.choice("weight_at", {"output", "input"}, "output") == "input";
  s.shared_d_ff = r.has("shared_d_ff") ? r.size("shared_d_ff", 0) : 0;
  s.shared_gate = r.flag("shared_expert_gate", false);
  if (s.shared_gate && s.shared_d_ff == 0)
    throw ConfigError("spec.shared_expert_gate needs shared experts (shared_d_ff > 0)");
  s.aux_losses = r.flag("aux_losses", false);
  s.loads = read_loads(r, s.router);
  s.experts = read_weight_format(r);
  check_weight_shape(s.experts, m.d_ff, m.d_model,
                     "an expert's w_gate and w_up (moe_d_ff, d_model)");
  check_weight_shape(s.experts, m.d_model, m.d_ff, "an expert's w_down (d_model, moe_d_ff)");
  try {
    m.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("spec: ") + e.what());
  }
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  write_router_sizes(s.router, j);
  j["moe_d_ff"] = s.moe.d_ff;
  j["shared_d_ff"] = s.shared_d_ff;
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  write_router_options(s.router, j);
  const bool clamped = s.moe.kind == ExpertKind::clamped_swiglu;
  j["expert_kind"] = clamped ? "clamped_swiglu" : "swiglu";
  if (clamped) {
    j["swiglu_alpha"] = s.moe.alpha;
    j["swiglu_limit"] = s.moe.limit;
  }
  j["expert_bias"] = s.expert_bias;
  j["weight_at"] = s.moe.weight_at_input ? "input" : "output";
  j["shared_expert_gate"] = s.shared_gate;
  j["aux_losses"] = s.aux_losses;
  if (!s.loads.empty()) j["expert_loads"] = s.loads;
  write_weight_format(s.experts, j);
}

// Quantized experts are the case's own quantization: no fp8 recipe on top of them.
void check_case(const Spec& spec, const OpCase& c) {
  if (!own(spec).experts.dense() && c.precision == Precision::fp8)
    throw ConfigError(
        "spec.precision fp8: the experts of a weight_format case are quantized "
        "already (give tf32, bf16 or fp16, or no precision)");
}

// The experts' pre-activations of a clamped SwiGLU are drawn wide enough that its clamps at
// `limit` are active for some of them: weights of 12 / sqrt(D) give them a spread of about 4.
double expert_amp(const MoeOpSpec& s) {
  const double d = static_cast<double>(s.moe.d_model);
  return (s.moe.kind == ExpertKind::clamped_swiglu ? 12.0 : 1.0) / std::sqrt(d);
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const index_t T = s.router.tokens, D = s.moe.d_model, F = s.moe.d_ff;
  const index_t E = s.router.router.experts, N = T * s.router.router.top_k;
  const double in_d = expert_amp(s), in_f = 1.0 / std::sqrt(static_cast<double>(F));
  router_inputs(s.router, t);
  for (const auto& w : kExpertWeights) {
    const index_t rows = w.down ? D : F, cols = w.down ? F : D;
    if (s.experts.dense()) {
      t.in.push_back(float_slot(w.name, {E, rows, cols}, Role::param, w.down ? in_f : in_d));
      continue;
    }
    // quantized experts have no gradient (weight-only quantization serves)
    for (auto& p : weight_slots(s.experts, w.name, rows, cols, Role::param, E))
      t.fixed.push_back(std::move(p));
  }
  if (s.expert_bias) {
    t.in.push_back(float_slot("param.experts.b_gate", {E, F}, Role::param, in_d));
    t.in.push_back(float_slot("param.experts.b_up", {E, F}, Role::param, in_d));
    t.in.push_back(float_slot("param.experts.b_down", {E, D}, Role::param, in_f));
  }
  if (const index_t Fs = s.shared_d_ff) {
    const double d = 1.0 / std::sqrt(static_cast<double>(D));
    t.in.push_back(float_slot("param.shared.gate.weight", {Fs, D}, Role::param, d));
    t.in.push_back(float_slot("param.shared.fc1.weight", {Fs, D}, Role::param, d));
    t.in.push_back(float_slot("param.shared.fc2.weight", {D, Fs}, Role::param,
                              1.0 / std::sqrt(static_cast<double>(Fs))));
    if (s.shared_gate)
      t.in.push_back(float_slot("param.shared_gate.weight", {1, D}, Role::param, d));
  }
  router_outputs(s.router, t, /*weights_grad=*/false);
  if (!s.experts.dense()) {
    for (const auto& w : kExpertWeights) {
      Slot d = float_slot(w.dequant, {E, w.down ? D : F, w.down ? F : D}, Role::output);
      d.optional = d.exact = d.no_grad = true;
      t.out.push_back(std::move(d));
    }
  }
  // the grouped layout, in pipeline order, then the shared experts and the block's output
  t.out.push_back(int_output("act.moe.expert_offsets", {E + 1}));
  t.out.push_back(int_output("act.moe.source_rows", {N}));
  for (const auto& [name, width] :
       {std::pair{"act.moe.expert_in", D}, std::pair{"act.moe.expert_hidden", F},
        std::pair{"act.moe.expert_out", D}}) {
    Slot a = float_slot(name, {N, width}, Role::output);
    a.no_grad = true;
    t.out.push_back(a);
  }
  if (s.shared_d_ff > 0) {
    Slot a = float_slot("act.moe.shared_out", {T, D}, Role::output);
    a.no_grad = true;
    t.out.push_back(a);
  }
  t.out.push_back(float_slot("output.y", {T, D}, Role::output));
  if (s.aux_losses) {
    t.out.push_back(float_slot("output.aux_loss", {}, Role::output));
    t.out.push_back(float_slot("output.z_loss", {}, Role::output));
  }
}

OpDef::IntBound int_bound(const Spec& spec, const std::string& name) {
  return router_int_bound(own(spec).router, name);
}

const RouterPart* router_of(const Spec& spec) {
  return &own(spec).router;
}

// The router's outputs as router_dependence says, y row by row (each token's output is its own
// experts'), the shared experts not at all; the grouped layout, the aux loss and every gradient
// as a whole.
detail::RoutingDependence routing_dependence(const Spec& spec, const std::string& name) {
  using detail::RoutingDependence;
  if (const auto d = router_dependence(own(spec).router, name)) return *d;
  if (name == "output.y") return RoutingDependence::token_rows;
  if (name == "act.moe.shared_out" || name.ends_with("_dequant")) return RoutingDependence::none;
  return RoutingDependence::whole;
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max(
      {s.moe.d_model, s.moe.d_ff, s.router.router.experts, s.router.tokens, s.shared_d_ff});
}

double working_bytes(const Spec& spec) {
  const auto& s = own(spec);
  const auto d = [](index_t x) { return static_cast<double>(x); };
  const double T = d(s.router.tokens), N = T * d(s.router.router.top_k);
  const double D = d(s.moe.d_model), F = d(s.moe.d_ff), E = d(s.router.router.experts);
  // the forward's activations and the backward's gradients of them, and the shared FFN's
  return 8 * (4 * T * E + 2 * N * (2 * D + 3 * F) + 2 * T * (2 * D + 3 * d(s.shared_d_ff)));
}

// Forced loads: the (token, slot) pairs dealt round-robin, expert after expert (so that an
// expert's n_e pairs fall on n_e distinct tokens, and every token gets k); the gate singles out
// expert e by dimension e (W_e = a u_e, a = 1/sqrt(D)), and token t's input is 2 - j/k on
// dimension e of its j-th expert, and uniform in [-0.5, 0.5) elsewhere: its choice is its
// experts in that order, each gap a / k or more.
void force_loads(const MoeOpSpec& s, const OpCase& c, Values& v) {
  const index_t T = s.router.tokens, D = s.moe.d_model, E = s.router.router.experts;
  const index_t k = s.router.router.top_k;
  std::vector<std::vector<index_t>> chosen(at(T));
  index_t next = 0;
  for (index_t e = 0; e < E; ++e)
    for (std::int64_t n = 0; n < s.loads[at(e)]; ++n) chosen[at(next++ % T)].push_back(e);
  auto& w = v.f.at("param.gate.weight");
  std::fill(w.begin(), w.end(), 0.0);
  const double a = 1.0 / std::sqrt(static_cast<double>(D));
  for (index_t e = 0; e < E; ++e) w[at(e * D + e)] = a;
  auto& x = v.f.at("input.x");
  for (index_t t = 0; t < T; ++t) {
    for (index_t i = 0; i < D; ++i) x[at(t * D + i)] *= 0.5;
    for (std::size_t j = 0; j < chosen[at(t)].size(); ++j)
      x[at(t * D + chosen[at(t)][j])] = 2.0 - static_cast<double>(j) / static_cast<double>(k);
  }
  as_stored(w, c);
  as_stored(x, c);
  if (auto it = v.f.find("param.gate.bias"); it != v.f.end())
    std::fill(it->second.begin(), it->second.end(), 0.0);
}

void draw(const Spec& spec, const OpCase& c, Values& v) {
  const auto& s = own(spec);
  if (!s.loads.empty()) force_loads(s, c, v);
  draw_router(s.router, c, v);
  if (s.experts.dense()) return;
  const index_t D = s.moe.d_model, F = s.moe.d_ff;
  for (const auto& w : kExpertWeights) {
    draw_weight(s.experts, w.name, w.down ? D : F, w.down ? F : D,
                w.down ? 1.0 / std::sqrt(static_cast<double>(F)) : expert_amp(s), c.seed, v,
                s.router.router.experts);
  }
}

std::string locate(const Spec& spec, const std::string& name, std::int64_t i) {
  const auto& s = own(spec);
  const index_t D = s.moe.d_model, F = s.moe.d_ff;
  for (const auto& w : kExpertWeights) {
    if (name == w.dequant)
      return locate_weight(s.experts, w.down ? D : F, w.down ? F : D, i, s.router.router.experts);
  }
  return "";
}

// Expert weight w: the case's own, or a quantized one's exact values (its _dequant output) as Real
// holds them, rounded as the precision stores them.
template <class Real>
Tensor<Real> expert_weight(RunContext<Real>& c, const ExpertWeight& w) {
  const auto& s = own(c.s);
  if (s.experts.dense()) return c.take(w.name);
  const index_t D = s.moe.d_model, F = s.moe.d_ff;
  const auto exact = dequantize_weight(s.experts, w.name, w.down ? D : F, w.down ? F : D, c.v,
                                       s.router.router.experts);
  auto& d = c.r.at(w.dequant);
  for (index_t i = 0; i < d.numel(); ++i) d[i] = static_cast<Real>(exact[i]);
  c.done(w.dequant);
  return d;
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  const RouterPart& p = s.router;
  const index_t T = p.tokens, E = p.router.experts, k = p.router.top_k, D = s.moe.d_model;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  const auto in_or_empty = [&](bool given, const char* name) {
    return given ? c.in(name) : Tensor<Real>();
  };
  const auto gate = c.in("param.gate.weight"), gate_b = in_or_empty(p.gate_bias, "param.gate.bias");
  const auto corr = in_or_empty(p.selection_bias, "param.gate.e_score_correction_bias");
  // the experts' weights, read once, are the case's largest tensors (RunContext::take)
  const auto wg = expert_weight(c, kExpertWeights[0]), wu = expert_weight(c, kExpertWeights[1]);
  const auto wd = expert_weight(c, kExpertWeights[2]);
  const auto bg = in_or_empty(s.expert_bias, "param.experts.b_gate");
  const auto bu = in_or_empty(s.expert_bias, "param.experts.b_up");
  const auto bd = in_or_empty(s.expert_bias, "param.experts.b_down");
  const auto ptr = [](const Tensor<Real>& t) { return t.empty() ? nullptr : t.data(); };
  const MoeWeights<Real> w{ptr(gate), ptr(gate_b), ptr(corr), wg.data(), wu.data(),
                           wd.data(), ptr(bg),     ptr(bu),   ptr(bd)};
  // every stage a backend stores is rounded where it is complete
  const MoeStore<Real> stored = [&](const char* stage, Real* data, index_t n) {
    // the routing weights' gradient stays internal to the op, and the shared experts' gated
    // output is the act.moe.shared_out result, as it always has been
    if (std::string_view(stage) == "grad.topk_weights" || std::string_view(stage) == "shared_out")
      return;
    if constexpr (std::is_same_v<Real, float>) {
      if (c.p && stores_reduced(*c.p) && round_to(*c.p, data, n))
        throw RangeError(std::string(stage) + ": " + overflow_message(*c.p));
    }
  };
  const std::vector<std::int32_t> replay = replayed_ids(p, c);
  MoeActs<Real> a;
  moe_forward(s.moe, w, x.data(), T, replay.empty() ? nullptr : replay.data(), a, stored);
  // the routing, as the router op writes it
  RouterRun<Real> routed;
  routed.logits = Tensor<Real>({T, E});
  std::copy(a.logits.begin(), a.logits.end(), routed.logits.data());
  routed.routing = a.routing;
  write_routing(p, c, routed);
  const auto put = [&](const char* name, const auto& values) {
    std::copy(values.begin(), values.end(), c.r.at(name).data());
  };
  put("act.moe.expert_offsets", a.offsets);
  put("act.moe.source_rows", a.source_rows);
  put("act.moe.expert_in", a.expert_in);
  put("act.moe.expert_hidden", a.hidden);
  put("act.moe.expert_out", a.expert_out);
  Tensor<Real>& y = c.r.at("output.y");
  put("output.y", a.y);
  // the shared experts: a dense SwiGLU FFN of width Fs on every token, times Qwen2-MoE's gate
  const auto shared_in = [&](const char* name) {
    return s.shared_d_ff > 0 &&
                   (s.shared_gate || std::string_view(name) != "param.shared_gate.weight")
               ? c.in(name)
               : Tensor<Real>();
  };
  const auto sg = shared_in("param.shared.gate.weight"), s1 = shared_in("param.shared.fc1.weight");
  const auto s2 = shared_in("param.shared.fc2.weight"), sgg = shared_in("param.shared_gate.weight");
  const SharedExpertWeights<Real> sw{ptr(sg), ptr(s1), ptr(s2), ptr(sgg)};
  SharedExpertActs<Real> sh;
  if (s.shared_d_ff > 0) {
    Tensor<Real>& shared = c.r.at("act.moe.shared_out");
    shared_experts_forward(sw, x.data(), T, D, s.shared_d_ff, sh, stored);
    put("act.moe.shared_out", sh.out);
    c.done("act.moe.shared_out");
    for (index_t i = 0; i < T * D; ++i) y[i] += shared[i];
  }
  c.done("output.y");
  Real aux_grad = 0, z_grad = 0;
  if (s.aux_losses) {
    c.r.at("output.aux_loss")[0] =
        load_balancing_loss(a.logits.data(), a.routing.ids.data(), T, E, k);
    c.done("output.aux_loss");
    c.r.at("output.z_loss")[0] = router_z_loss(a.logits.data(), T, E);
    c.done("output.z_loss");
    aux_grad = c.in("grad.output.aux_loss")[0];
    z_grad = c.in("grad.output.z_loss")[0];
  }
  // backward: the routed experts and the router (which writes dx), then the shared experts
  const auto grad = [&](bool given, const char* name) {
    return given ? c.r.at(name).data() : static_cast<Real*>(nullptr);
  };
  // quantized experts' gradients are not results: computed aside and dropped
  const bool dense = s.experts.dense();
  Tensor<Real> aside[3];
  const auto expert_grad = [&](int i, const Tensor<Real>& weight) {
    if (dense) return c.r.at(std::string("grad.") + kExpertWeights[i].name).data();
    aside[i] = Tensor<Real>(weight.shape());
    return aside[i].data();
  };
  MoeGrads<Real> g{grad(true, "grad.param.gate.weight"),
                   grad(p.gate_bias, "grad.param.gate.bias"),
                   expert_grad(0, wg),
                   expert_grad(1, wu),
                   expert_grad(2, wd),
                   grad(s.expert_bias, "grad.param.experts.b_gate"),
                   grad(s.expert_bias, "grad.param.experts.b_up"),
                   grad(s.expert_bias, "grad.param.experts.b_down")};
  Real* dx = c.r.at("grad.input.x").data();
  moe_backward(s.moe, w, x.data(), T, a, dy.data(), aux_grad, z_grad, dx, g, stored);
  if (s.shared_d_ff > 0) {
    SharedExpertGrads<Real> sgr{grad(true, "grad.param.shared.gate.weight"),
                                grad(true, "grad.param.shared.fc1.weight"),
                                grad(true, "grad.param.shared.fc2.weight"),
                                grad(s.shared_gate, "grad.param.shared_gate.weight")};
    shared_experts_backward(sw, x.data(), T, D, s.shared_d_ff, sh, dy.data(), dx, sgr, stored);
  }
}

}  // namespace

const OpDef& moe_op() {
  static const OpDef def{
      .name = "moe",
      .config_keys = {},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .int_bound = int_bound,
      .router_of = router_of,
      .routing_dependence = routing_dependence,
      .tensors = tensors,
      .check_case = check_case,
      .locate = locate,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .taken = {"param.experts.w_gate", "param.experts.w_up", "param.experts.w_down"},
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"tokens": 6, "d_model": 5, "num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 3, "norm_topk_prob": true})",
           R"({"tokens": 5, "d_model": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_d_ff": 3, "router_scoring": "sigmoid", "selection_bias": true, "router_groups": 4, "topk_groups": 2, "routed_scaling_factor": 2.5, "shared_d_ff": 4, "aux_losses": true})",
           R"({"tokens": 5, "d_model": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 3, "router_order": "topk_then_score", "router_bias": true, "expert_kind": "clamped_swiglu", "expert_bias": true})",
           R"({"tokens": 4, "d_model": 3, "num_experts": 4, "num_experts_per_tok": 1, "moe_d_ff": 2, "router_scoring": "sigmoid", "router_order": "topk_then_score", "weight_at": "input", "shared_d_ff": 3, "shared_expert_gate": true, "replay_routing": true, "clear_margins": false})",
           R"({"tokens": 6, "d_model": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_d_ff": 2, "expert_loads": [0, 1, 5, 6]})",
           R"({"tokens": 5, "d_model": 32, "num_experts": 3, "num_experts_per_tok": 2, "moe_d_ff": 32, "weight_format": "mxfp4"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
