// Internal: what model.cpp (forward, backward) and params.cpp (parameters, validation) share.
#pragma once

#include <string>

#include "teo/config.hpp"
#include "teo/layers/attention.hpp"
#include "teo/tensor.hpp"

namespace teo::detail {

// The shape of parameter `name` (a contract name such as "layers.0.fc1.weight") under `c`.
Shape param_shape(const EncoderConfig& c, const std::string& name);

// The attention variant of cfg (docs/semantics.md section 14): its K/V heads, window, soft-cap and
// ALiBi, with the sinks (H) and where their gradient goes (null unless attn_sinks).
template <class Real>
AttentionVariant<Real> attention_variant(const EncoderConfig& cfg, const Real* sinks,
                                         Real* dsinks = nullptr) {
  AttentionVariant<Real> v;
  v.kv_heads = cfg.kv_heads();
  v.window = cfg.sliding_window;
  v.softcap = cfg.attn_logit_softcap;
  if (cfg.positional == Positional::alibi) v.alibi_max_bias = cfg.alibi_max_bias;
  if (cfg.attn_sinks) {
    v.sinks = sinks;
    v.dsinks = dsinks;
  }
  return v;
}

}  // namespace teo::detail
