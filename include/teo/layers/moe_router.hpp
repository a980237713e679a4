// The mixture-of-experts router on a token's logits (docs/semantics.md, "The router"): scoring,
// group-limited top-k selection with DeepSeek-V3's correction bias, the routing weights, their
// exact backward, and the two auxiliary losses of training. The gate's product (logits = x W^T +
// b) is the caller's linear_forward.
#pragma once

#include <cstdint>
#include <vector>

#include "teo/errors.hpp"
#include "teo/moe_kinds.hpp"

namespace teo {

struct RouterSpec {
  index_t experts = 0;  // E
  index_t top_k = 1;    // k
  RouterScoring scoring = RouterScoring::softmax;
  RouterOrder order = RouterOrder::score_then_topk;
  // Group-limited choice: the E experts in `groups` consecutive groups of E / groups; only the
  // experts of the `topk_groups` best groups are eligible. groups 1: every expert is.
  index_t groups = 1, topk_groups = 1;
  GroupScore group_score = GroupScore::top2_sum;
  bool norm_topk_prob = false;         // divide the k weights by their sum
  double routed_scaling_factor = 1.0;  // then multiply them by this
  // ConfigError naming the key: E >= 1, 1 <= k <= the eligible experts, groups dividing E,
  // 1 <= topk_groups <= groups, two experts per group for top2_sum, a finite positive factor.
  void validate() const;
};

// What the router chose for T tokens.
template <class Real>
struct Routing {
  // (T, E). score_then_topk: every expert's score (softmax over E, or each sigmoid).
  // topk_then_score: the k chosen experts' scores (softmax over the k chosen logits, or each
  // sigmoid), 0 elsewhere, as Hugging Face's gpt-oss and Llama 4 routers return them.
  std::vector<Real> scores;
  // (T, k): the chosen experts, in descending selection score; equal scores go to the lower
  // expert index first. A selection score is the score (score_then_topk) or the logit
  // (topk_then_score), plus the correction bias when one is given.
  std::vector<std::int32_t> ids;
  // (T, k): each chosen expert's score, divided by the k scores' sum with norm_topk_prob, times
  // routed_scaling_factor.
  std::vector<Real> weights;
  // (T): how far `ids` is from changing, in selection-score units: the smallest of the gaps
  // between consecutive chosen experts (ids[j] minus ids[j+1], their order), the k-th eligible
  // selection score minus the (k+1)-th, and with groups the topk_groups-th group score minus the
  // next one. +inf when nothing is left to choose or order; 0 at a tie; negative when `ids` was
  // replayed and is not the router's own choice.
  std::vector<Real> margin;
};

// Routes `tokens` rows of `logits` (T, E). correction (E) or null: DeepSeek-V3's
// e_score_correction_bias, added to the selection scores for choosing only, never to the
// weights. replay (T, k) or null: the choice is given (router replay: the golden's routing fed to
// a backend) and only the weights and margins are computed; each id must be an eligible expert,
// once per token. A non-finite logit is a RangeError.
template <class Real>
void route(const RouterSpec& spec, const Real* logits, const Real* correction,
           const std::int32_t* replay, index_t tokens, Routing<Real>& out);

// dlogits (T, E), written: the gradient of sum(dweights * weights) through the scoring, the
// renormalisation and the scaling. The selection is piecewise constant: no gradient reaches it,
// nor the correction bias.
template <class Real>
void route_backward(const RouterSpec& spec, const Routing<Real>& r, const Real* dweights,
                    index_t tokens, Real* dlogits);

// The Switch load-balancing loss as Hugging Face's load_balancing_loss_func computes it:
// E * sum_e f_e P_e, with P_e the mean over tokens of softmax(logits)_e (softmax whatever the
// scoring) and f_e the (token, slot) pairs routed to e over T. 0 for no token.
template <class Real>
Real load_balancing_loss(const Real* logits, const std::int32_t* ids, index_t tokens,
                         index_t experts, index_t top_k);
// Adds dloss * d(loss)/d(logits) into dlogits (T, E).
template <class Real>
void load_balancing_loss_backward(const Real* logits, const std::int32_t* ids, index_t tokens,
                                  index_t experts, index_t top_k, Real dloss, Real* dlogits);

// ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2. 0 for no token.
template <class Real>
Real router_z_loss(const Real* logits, index_t tokens, index_t experts);
// Adds dloss * d(loss)/d(logits) into dlogits (T, E).
template <class Real>
void router_z_loss_backward(const Real* logits, index_t tokens, index_t experts, Real dloss,
                            Real* dlogits);

}  // namespace teo
