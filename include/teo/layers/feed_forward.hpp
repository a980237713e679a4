// The FFN's element-wise activations. The two Linear layers around them are linear.hpp.
#pragma once

#include <cstdint>

#include "teo/config.hpp"
#include "teo/kernels.hpp"

namespace teo {

// out[i] = act(in[i]); relu(x) = max(x, 0), with relu(NaN) = NaN as in PyTorch;
// gelu(x) = 0.5 x (1 + erf(x / sqrt 2));
// gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
template <class Real>
void activation_forward(Real* out, const Real* in, index_t n, Activation act);

// Accumulates din[i] += act'(in[i]) * dout[i], with relu'(0) = 0; with write == overwrite,
// din[i] = 0 + act'(in[i]) * dout[i] (din is never read).
template <class Real>
void activation_backward(Real* din, const Real* dout, const Real* in, index_t n, Activation act,
                         GradWrite write = GradWrite::accumulate);

// The gated FFN's middle (SwiGLU, GeGLU): hidden[i] = act(gate[i]) * up[i].
template <class Real>
void gated_forward(Real* hidden, const Real* gate, const Real* up, index_t n, Activation act);

// Its backward, both overwritten: dgate[i] = act'(gate[i]) * (dhidden[i] * up[i]) (the bits of
// activation_backward overwriting, given dhidden * up) and dup[i] = act(gate[i]) * dhidden[i].
template <class Real>
void gated_backward(Real* dgate, Real* dup, const Real* dhidden, const Real* gate, const Real* up,
                    index_t n, Activation act);

// The FFN's element-wise middle, fc1's bias, the activation and (in training) the dropout, as one
// parallel pass over the (rows, cols) hidden tensor, each thread taking its block of rows through
// the three steps in turn (one fork and join instead of three). The bits are those of the three
// passes:
//   pre += bias (add_bias);  hidden = act(pre);  dropped = dropout(hidden) when mask is not null.
// bias may be null; dropped is not written without a mask.
template <class Real>
void ffn_hidden_forward(Real* pre, Real* hidden, Real* dropped, const Real* bias,
                        const std::uint8_t* mask, Real scale, index_t rows, index_t cols,
                        Activation act);

// Its backward, the same way: with a mask, dhidden = dropout'(ddropped), overwritten; without one,
// dhidden is the gradient given (ddropped is not read). Then dpre = act'(pre) * dhidden,
// overwritten. The bits are those of dropout_backward and activation_backward overwriting.
template <class Real>
void ffn_hidden_backward(Real* dpre, Real* dhidden, const Real* ddropped, const std::uint8_t* mask,
                         Real scale, const Real* pre, index_t rows, index_t cols, Activation act);

}  // namespace teo
