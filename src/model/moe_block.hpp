// Internal: an MoE layer's FFN in the model (docs/semantics.md, 19.4): the routed experts
// (teo/layers/moe.hpp) and the shared experts on the layer's N = B S positions, every position
// routed, and the router's loss terms over every MoE layer's real tokens at once.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "model/pass.hpp"
#include "teo/model.hpp"

namespace teo::detail {

// ffn_out (N, D) = the routed experts' y + the shared experts' output, from ffn_in (N, D); keeps
// L.moe, the shared experts' tensors and the named moe.* activations (rounded where produced).
// replay (tokens * k) or null: the experts given (router replay).
template <class Real>
void moe_block_forward(const ModelConfig& cfg, const LayerParams<Real>& P, LayerActs<Real>& L,
                       const Real* ffn_in, index_t tokens, const std::int32_t* replay,
                       std::string_view name, const Emulation<Real>& store);

// From dL.ffn_out: dffn_in (N, D), overwritten or accumulated into as `write` says; the MoE
// parameters' gradients accumulated into G; dL's moe.* gradients written. dlogits_extra (N, E) or
// null: the loss terms' gradient of this layer's logits (moe_losses_backward).
template <class Real>
void moe_block_backward(const ModelConfig& cfg, const LayerParams<Real>& P,
                        const LayerActs<Real>& L, LayerParams<Real>& G, LayerActs<Real>& dL,
                        const Real* ffn_in, Real* dffn_in, GradWrite write, index_t tokens,
                        const Real* dlogits_extra, std::string_view name,
                        const Emulation<Real>& store);

// The router's loss terms after a forward pass: acts.moe_aux_loss and acts.moe_z_loss (those
// allocated), over the real tokens (s < lengths[b]) of every MoE layer, concatenated in layer
// order; returns router_aux_loss_coef * aux + router_z_loss_coef * z, which the loss adds.
template <class Real>
Real moe_losses_forward(const ModelConfig& cfg, const Batch& batch, Activations<Real>& acts);

// Their gradient with respect to each layer's logits, for a loss gradient dloss: one (N, E)
// array per layer (empty for a dense layer, or when neither term is on).
template <class Real>
std::vector<std::vector<Real>> moe_losses_backward(const ModelConfig& cfg, const Batch& batch,
                                                   const Activations<Real>& acts, Real dloss);

}  // namespace teo::detail
