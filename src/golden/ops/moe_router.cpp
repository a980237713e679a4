// The moe_router op (docs/golden-format.md, "Op cases"): a mixture of experts' router on T
// tokens: the gate's logits, the scores, the top-k choice (group-limited, with DeepSeek-V3's
// correction bias), the routing weights, each token's selection margin, and the auxiliary
// losses of training, with the exact backward of the weights and the losses (docs/semantics.md,
// 19.1).
#include <algorithm>
#include <cmath>

#include "golden/ops/op.hpp"
#include "golden/ops/router_spec.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: the router part, and whether the auxiliary losses are outputs.
struct MoeRouterSpec {
  RouterPart router;
  bool aux_losses = true;
};

const MoeRouterSpec& own(const Spec& s) {
  return s.as<MoeRouterSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<MoeRouterSpec>();
  s.router = read_router(r);
  s.aux_losses = r.flag("aux_losses", true);
}

void write_sizes(const Spec& spec, ojson& j) {
  write_router_sizes(own(spec).router, j);
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  write_router_options(s.router, j);
  j["aux_losses"] = s.aux_losses;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  router_inputs(s.router, t);
  router_outputs(s.router, t, /*weights_grad=*/true);
  if (s.aux_losses) {
    t.out.push_back(float_slot("output.aux_loss", {}, Role::output));
    t.out.push_back(float_slot("output.z_loss", {}, Role::output));
  }
}

OpDef::IntBound int_bound(const Spec& spec, const std::string& name) {
  return router_int_bound(own(spec).router, name);
}

index_t longest_reduction(const Spec& spec) {
  const auto& p = own(spec).router;
  return std::max({p.d_model, p.router.experts, p.tokens});
}

const RouterPart* router_of(const Spec& spec) {
  return &own(spec).router;
}

// The router's outputs as router_dependence says; the aux loss and every gradient (the aux loss's
// reaches every logit) as a whole.
detail::RoutingDependence routing_dependence(const Spec& spec, const std::string& name) {
  return router_dependence(own(spec).router, name).value_or(detail::RoutingDependence::whole);
}

void draw(const Spec& spec, const OpCase& c, Values& v) {
  draw_router(own(spec).router, c, v);
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  const RouterPart& p = s.router;
  const index_t T = p.tokens, E = p.router.experts, k = p.router.top_k;
  const auto x = c.in("input.x"), dw = c.in("grad.output.topk_weights");
  const RouterRun<Real> routed = router_forward(p, c, x);
  write_routing(p, c, routed);
  Real aux_grad = 0, z_grad = 0;
  if (s.aux_losses) {
    c.r.at("output.aux_loss")[0] =
        load_balancing_loss(routed.logits.data(), routed.routing.ids.data(), T, E, k);
    c.done("output.aux_loss");
    c.r.at("output.z_loss")[0] = router_z_loss(routed.logits.data(), T, E);
    c.done("output.z_loss");
    aux_grad = c.in("grad.output.aux_loss")[0];
    z_grad = c.in("grad.output.z_loss")[0];
  }
  const std::vector<Real> dweights(dw.begin(), dw.end());
  router_backward(p, c, x, routed, dweights, aux_grad, z_grad, c.r.at("grad.input.x").data());
}

}  // namespace

const OpDef& moe_router_op() {
  static const OpDef def{
      .name = "moe_router",
      .config_keys = {},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .int_bound = int_bound,
      .router_of = router_of,
      .routing_dependence = routing_dependence,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"tokens": 6, "d_model": 5, "num_experts": 4, "num_experts_per_tok": 2})",
           R"({"tokens": 5, "d_model": 4, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true, "routed_scaling_factor": 2.5, "router_bias": true, "aux_losses": false})",
           R"({"tokens": 6, "d_model": 4, "num_experts": 8, "num_experts_per_tok": 2, "router_scoring": "sigmoid", "selection_bias": true, "router_groups": 4, "topk_groups": 2, "norm_topk_prob": true})",
           R"({"tokens": 4, "d_model": 3, "num_experts": 4, "num_experts_per_tok": 2, "router_order": "topk_then_score", "router_bias": true, "replay_routing": true})",
           R"({"tokens": 4, "d_model": 3, "num_experts": 4, "num_experts_per_tok": 1, "router_scoring": "sigmoid", "router_order": "topk_then_score", "router_groups": 2, "topk_groups": 1, "group_score": "max", "ties": true})"},
  };
  return def;
}

}  // namespace teo::golden::ops
