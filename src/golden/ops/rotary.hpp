// RoPE of the attention ops at per-sequence positions (docs/semantics.md): row i of sequence b
// sits at position shift[b] + i, plus the config's position offset, which the table holds.
#pragma once

#include <vector>

#include "teo/config.hpp"
#include "teo/layers/rope.hpp"
#include "teo/tensor.hpp"

namespace teo::golden::ops {

template <class Real>
struct Rotary {
  Tensor<Real> cos, sin;
  std::vector<index_t> shift;  // per sequence
  index_t rd = 0;
  RopeStyle style = RopeStyle::neox;

  // The table covers positions [0, end); every shift[b] + rows must stay within it.
  Rotary(const ModelConfig& cfg, std::vector<index_t> shifts, index_t end)
      : cos({end, cfg.rotary() / 2}),
        sin({end, cfg.rotary() / 2}),
        shift(std::move(shifts)),
        rd(cfg.rotary()),
        style(cfg.attention.rope_style) {
    rope_table(cos.data(), sin.data(), cfg, end);
  }

  // x (B, heads, rows, Dh) rotated into out, or rotated back (the gradient) when back is set,
  // sequence b from position shift[b].
  void apply(Real* out, const Real* x, index_t heads, index_t rows, index_t d_head,
             bool back) const {
    const index_t per = heads * rows * d_head;
    for (std::size_t b = 0; b < shift.size(); ++b) {
      const index_t at = shift[b] * (rd / 2), o = static_cast<index_t>(b) * per;
      if (back) {
        rope_backward(out + o, x + o, cos.data() + at, sin.data() + at, heads, rows, d_head, rd,
                      style);
      } else {
        rope_forward(out + o, x + o, cos.data() + at, sin.data() + at, heads, rows, d_head, rd,
                     style);
      }
    }
  }
};

}  // namespace teo::golden::ops
