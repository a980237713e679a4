// The mixture of experts' kinds and the rules of their sizes, below the layers: the model's config
// (teo/config.hpp, MoeConfig) and the router and experts (teo/layers/moe_router.hpp, moe.hpp)
// share them.
#pragma once

#include "teo/errors.hpp"

namespace teo {

enum class RouterScoring { softmax, sigmoid };
// score_then_topk (Mixtral, Qwen, DeepSeek): score all E experts, then take the top k scores.
// topk_then_score (gpt-oss with softmax, Llama 4 with sigmoid): take the top k logits, then score
// those k only (softmax over the k, or each one's sigmoid).
enum class RouterOrder { score_then_topk, topk_then_score };
// A group's score for group-limited choice: the sum of its two largest selection scores
// (DeepSeek-V3) or its largest (DeepSeek-V2).
enum class GroupScore { top2_sum, max };
// swiglu: h = silu(x W_gate^T + b_gate) * (x W_up^T + b_up) (Mixtral, Qwen, DeepSeek, Llama 4).
// clamped_swiglu (gpt-oss): g = min(x W_gate^T + b_gate, limit), u = clamp(x W_up^T + b_up,
// -limit, limit), h = (u + 1) * g * sigmoid(alpha g).
enum class ExpertKind { swiglu, clamped_swiglu };

namespace detail {

// ConfigError naming the key: E >= 1, groups dividing E, 1 <= topk_groups <= groups, two experts
// per group for top2_sum, 1 <= k <= the eligible experts, a finite positive scaling factor.
void validate_router_keys(index_t experts, index_t top_k, index_t groups, index_t topk_groups,
                          GroupScore group_score, double routed_scaling_factor);
// ConfigError: d_model and d_ff of at least 1; a clamped SwiGLU's alpha and limit finite and
// positive.
void validate_expert_keys(ExpertKind kind, index_t d_model, index_t d_ff, double alpha,
                          double limit);

}  // namespace detail
}  // namespace teo
