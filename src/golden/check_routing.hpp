// The checker's judgement of a routed case's routing (docs/golden-format.md, "Routing"): the
// experts each token chose, exactly, an ambiguous routing told from a wrong one, and what an
// ambiguous token contaminates.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "golden_internal.hpp"
#include "teo/config.hpp"
#include "teo/golden.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::golden::detail {

// A routed case's output.topk_ids, judged exactly, token by token: a token routed otherwise is
// ambiguous when the golden's margin is within what precision p can move it, the routing was not
// replayed, and the candidate's choice is a top-k choice of the golden's selection scores moved
// by at most that much (a margin of exactly 0 is a tie, which the tie rule decides); anything
// else is a wrong expert.
struct RoutingJudgement {
  TensorResult ids;
  std::vector<AmbiguousToken> ambiguous;
  std::set<std::int64_t> rows;  // the ambiguous tokens
};
RoutingJudgement judge_routing(const safetensors::File& golden, const safetensors::File& candidate,
                               const RoutedCase& rc, bool f32, Precision p);

// The candidate tensor c with the rows of `rows` (its first dimension is the token) replaced by
// the golden's values, in `dtype`: what is judged of a tensor ambiguous tokens contaminate row by
// row.
safetensors::Tensor without_rows(const safetensors::Tensor& c, const safetensors::Tensor& g,
                                 const std::set<std::int64_t>& rows, safetensors::DType dtype);

// An integer result other than the choice (the grouped layout's offsets and source rows), judged
// exactly: pass when every entry is the golden's, else fail naming the first that is not. I32 or
// I64 candidates are read.
TensorResult judge_exact_ints(const safetensors::Tensor& g, const safetensors::Tensor* c);

// "3, 7, 12" (the first 8, then "...").
std::string tokens_str(const std::set<std::int64_t>& rows);

// A model case's routing (ffn "moe"): each MoE layer's act.layers.{i}.moe.topk_ids judged as an
// op case's output.topk_ids is, position by position (position b S + s), with a tolerance from
// the logits' error: tol = 2 (c dl + (E + 4) u32), c as routing_tolerance's, dl the candidate's
// own error on that position's logits (act.layers.{i}.moe.logits against the truth), or without
// its logits kModelRoutingK times the error of the run in precision p (the emulated run, or a
// float32 golden's own), at least the gate product's rounding in p. A layer after the first with
// an ambiguous position is not judged.
inline constexpr double kModelRoutingK = 2.0;
struct ModelRoutingJudgement {
  std::map<std::string, TensorResult> ids;  // by name: act.layers.{i}.moe.topk_ids
  std::vector<AmbiguousToken> ambiguous;
  index_t first_layer = -1;     // the first layer with an ambiguous position, or -1
  std::set<std::int64_t> rows;  // its ambiguous positions
};
ModelRoutingJudgement judge_model_routing(const safetensors::File& golden,
                                          const safetensors::File& candidate,
                                          const ModelConfig& cfg, bool f32, Precision p,
                                          const std::map<std::string, std::vector<double>>& emu);

// Whether tensor `name` of a model case is computed from layer `layer`'s routing: that layer's
// tensors from its topk_ids on (its shared experts' excepted), every later layer's, the top of
// the model, the loss terms, every gradient and the generation steps.
bool after_routing(const std::string& name, index_t layer, const ModelConfig& cfg);

// The positions of an MoE model case whose drawn routing is not clear of precision p: those whose
// margin is at most twice the tolerance judge_model_routing gives a candidate without logits.
struct UnclearPosition {
  index_t layer = 0, position = 0;
  double margin = 0, tolerance = 0;
};
std::vector<UnclearPosition> unclear_routing(const safetensors::File& golden,
                                             const ModelConfig& cfg, bool f32, Precision p,
                                             const std::map<std::string, std::vector<double>>& emu);

}  // namespace teo::golden::detail
