// Greedy generation by a decoder with a KV cache: the prompt's forward pass, then one token per
// step through the cached keys and values (docs/semantics.md, section 17.3).
#pragma once

#include <cstdint>
#include <vector>

#include "teo/model.hpp"

namespace teo {

// steps >= 0; with an empty prompt (length 0) step 0 feeds start_token. With `feed` (steps rows of
// B tokens), step t feeds feed[t] instead of the greedy choices (teacher forcing: the tokens an
// engine under test chose), and start_token is not used.
struct GenerateOptions {
  index_t steps = 0;
  std::int64_t start_token = 0;
  const std::vector<std::vector<std::int64_t>>* feed = nullptr;
};

template <class Real>
struct Generation {
  // Per step t: the token fed to each sequence (B) and the logits after it (B, V). The token fed
  // at step t + 1 is the first largest logit of step t; step 0's is the prompt's last position's
  // (the start token after an empty prompt).
  std::vector<std::vector<std::int64_t>> tokens;
  std::vector<Tensor<Real>> logits;
};

// prompt: token ids (B, S) with lengths[b] the prompt of sequence b (0 allowed) and no labels.
// Runs forward() on the prompt (eval mode), keeps every layer's keys (after RoPE) and values in a
// cache of prompt_length + steps rows per sequence, then `steps` decode steps: sequence b's step t
// feeds its token at position lengths[b] + t, appends its key and value, and attends to the
// lengths[b] + t + 1 cached positions. ConfigError unless params is a decoder's; ShapeError when a
// sequence would run past max_len. Step t's logits are the full causal forward's at position
// lengths[b] + t of the sequence grown by the fed tokens, to rounding (tests/model/generate_test).
template <class Real>
Generation<Real> generate(const Params<Real>& params, const Batch& prompt,
                          const GenerateOptions& opts);

}  // namespace teo
