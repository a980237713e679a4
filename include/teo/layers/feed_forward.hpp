// The FFN's element-wise activations. The two Linear layers around them are linear.hpp.
#pragma once

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

}  // namespace teo
