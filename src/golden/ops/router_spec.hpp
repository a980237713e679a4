// What the two mixture-of-experts ops share (moe_router.cpp, moe.cpp): the router's keys, its
// tensors, the draw that keeps every token's choice clear of the judged precision's tolerance,
// and the router's forward and backward through the op's emulated precision.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "golden/ops/op.hpp"
#include "teo/layers/moe_router.hpp"

namespace teo::golden::ops {

// The router part of an op spec: the tokens (T) of d_model (D), the router, and the options of
// its tensors.
struct RouterPart {
  index_t tokens = 0, d_model = 0;
  RouterSpec router;
  bool gate_bias = false;       // param.gate.bias (gpt-oss)
  bool selection_bias = false;  // param.gate.e_score_correction_bias (DeepSeek-V3)
  bool replay = false;          // input.moe.topk_ids: the routing given (router replay)
  bool ties = false;            // expert 1's gate is expert 0's: their scores tie exactly
  // Redraw each token whose margin is within twice the judged precision's tolerance (the
  // default). false (spec key clear_margins, with replay_routing only): keep the draw as it is,
  // which a real-size router (k 8 of 128 at D 2048) needs, since its chosen experts' consecutive
  // gaps are rarely all clear; the replayed routing is judged exactly, its margins do not matter.
  bool clear_margins = true;
};

// Reads tokens, d_model and the router's keys (num_experts, num_experts_per_tok, router_scoring,
// router_order, router_groups, topk_groups, group_score, norm_topk_prob, routed_scaling_factor,
// router_bias, selection_bias, replay_routing, ties, clear_margins); ConfigError naming the key.
RouterPart read_router(Reader& r);
// Writes them back, normalised: the group keys only with groups.
void write_router_sizes(const RouterPart& p, ojson& j);
void write_router_options(const RouterPart& p, ojson& j);

// The router's inputs: input.x (T, D), input.moe.topk_ids (T, k) with replay, the correction
// bias, param.gate.weight (E, D) and param.gate.bias (E).
void router_inputs(const RouterPart& p, OpTensors& t);
// The router's outputs: output.logits, output.scores (both optional), output.topk_ids,
// output.topk_weights, output.selection_margin (optional); `weights_grad` whether topk_weights
// takes an upstream gradient (the router op's; the moe op's weights are internal).
void router_outputs(const RouterPart& p, OpTensors& t, bool weights_grad);
// How a router output depends on the routing (the logits and z-loss not at all, score_then_topk's
// scores neither, the choice, its weights and margins and topk_then_score's scores row by row),
// or nothing for a name that is not one.
std::optional<detail::RoutingDependence> router_dependence(const RouterPart& p,
                                                           const std::string& name);
// Integer inputs: input.moe.topk_ids in [0, num_experts).
OpDef::IntBound router_int_bound(const RouterPart& p, const std::string& name);

// The draw: ties copy expert 0's gate row (and biases) to expert 1; each token whose margin is
// within twice the tolerance of the case's precision (fp32 for float32 and float64 cases; the
// precision of a precision case) is redrawn, input.x's row from its own stream, until it is
// not (a margin of 0 in a tie case is the tie, and stays); replay writes the router's own choice
// as input.moe.topk_ids.
void draw_router(const RouterPart& p, const OpCase& c, Values& v);

// The router's forward in Real: logits (T, E) = x W^T + b (never in fp8: the gate keeps its
// storage precision, as DeepSeek-V3's fp8 recipe does), then the routing (replayed when the case
// gives input.moe.topk_ids).
template <class Real>
struct RouterRun {
  Tensor<Real> logits;
  Routing<Real> routing;
};
template <class Real>
RouterRun<Real> router_forward(const RouterPart& p, RunContext<Real>& c, const Tensor<Real>& x);
// The routing to replay, (T k) ids: the golden's when the checker emulates a precision
// (RunContext::routing), else the case's input.moe.topk_ids with replay_routing; empty when the
// router routes by itself.
template <class Real>
std::vector<std::int32_t> replayed_ids(const RouterPart& p, const RunContext<Real>& c);
// Writes output.logits, output.scores, output.topk_ids, output.topk_weights and
// output.selection_margin, each rounded as stored.
template <class Real>
void write_routing(const RouterPart& p, RunContext<Real>& c, const RouterRun<Real>& run);
// The backward from the routing weights' gradient and the aux losses' upstream gradients into
// dlogits, then through the gate into grad.input.x (accumulated into dx) and the gate's
// parameters.
template <class Real>
void router_backward(const RouterPart& p, RunContext<Real>& c, const Tensor<Real>& x,
                     const RouterRun<Real>& run, const std::vector<Real>& dweights, Real aux_grad,
                     Real z_grad, Real* dx);

}  // namespace teo::golden::ops
