// One forward and backward pass of a small encoder through the installed library.
#include <cmath>
#include <cstdio>

#include "teo/model.hpp"

int main() {
  teo::ModelConfig cfg;  // vocab 64, d_model 16, 2 heads, 2 layers, 4 classes
  const auto params = teo::Params<double>::init(cfg, 0);
  const auto batch = teo::Batch::random(cfg, 3, 8, 1, {8, 5, 1});
  teo::Activations<double> acts, dacts;
  teo::Params<double> grads;
  teo::forward(params, batch, acts);
  teo::backward(params, batch, acts, grads, dacts);
  const double loss = acts.loss[0];
  std::printf("loss %.17g, %lld parameters, d head.bias[0] %.17g\n", loss,
              static_cast<long long>(params.count()), grads.head_bias[0]);
  return std::isfinite(loss) && loss > 0 ? 0 : 1;
}
