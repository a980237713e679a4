// The routing tolerance (golden/routing.hpp).
#include "golden/routing.hpp"

#include <algorithm>
#include <cmath>

namespace teo::golden::detail {

std::vector<double> routing_tolerance(const RouterSpec& router, const double* x, const double* w,
                                      const double* b, index_t tokens, index_t d_model,
                                      Precision p) {
  const index_t E = router.experts, D = d_model;
  // the logits' storage, tf32's products and the accumulation
  const double u_store = unit_roundoff(p == Precision::tf32 ? Precision::fp32 : storage_format(p));
  const double u_mul = p == Precision::tf32 ? unit_roundoff(Precision::tf32) : 0.0;
  const double u_acc = unit_roundoff(p == Precision::fp64 ? Precision::fp64 : Precision::fp32);
  const double u32 = unit_roundoff(Precision::fp32);
  const double terms = static_cast<double>(D + E);
  const bool logits_choose = router.order == RouterOrder::topk_then_score;
  const double groups = router.groups > 1 && router.group_score == GroupScore::top2_sum ? 2 : 1;
  std::vector<double> tol(static_cast<std::size_t>(std::max<index_t>(tokens, 0)), 0.0);
  std::vector<double> l(static_cast<std::size_t>(E));
  for (index_t t = 0; t < tokens; ++t) {
    double dl = 0, top = -INFINITY;
    for (index_t e = 0; e < E; ++e) {
      double v = b ? b[e] : 0.0, mag = b ? std::abs(b[e]) : 0.0;
      for (index_t i = 0; i < D; ++i) {
        v += x[t * D + i] * w[e * D + i];
        mag += std::abs(x[t * D + i]) * std::abs(w[e * D + i]);
      }
      l[static_cast<std::size_t>(e)] = v;
      top = std::max(top, v);
      dl = std::max(dl, u_store * std::abs(v) + (2 * u_mul + terms * u_acc) * mag);
    }
    double c = 2;
    if (!logits_choose && router.scoring == RouterScoring::sigmoid) c = 0.5;
    if (!logits_choose && router.scoring == RouterScoring::softmax) {
      // the largest softmax probability: exp(0) over the sum
      double sum = 0;
      for (double v : l) sum += std::exp(v - top);
      c = 4 / sum;
    }
    tol[static_cast<std::size_t>(t)] = 2 * (groups * c * dl + (static_cast<double>(E) + 4) * u32);
  }
  return tol;
}

}  // namespace teo::golden::detail
