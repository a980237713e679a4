// The routing tolerance (golden/routing.hpp).
#include "golden/routing.hpp"

#include <algorithm>
#include <cmath>

namespace teo::golden::detail {

namespace {

// the logits l = x W^T + b of one token (E), and dl, their rounding's bound
double token_logits(const double* x, const double* w, const double* b, index_t E, index_t D,
                    double u_store, double u_prod, double* l) {
  double dl = 0;
  for (index_t e = 0; e < E; ++e) {
    double v = b ? b[e] : 0.0, mag = b ? std::abs(b[e]) : 0.0;
    for (index_t i = 0; i < D; ++i) {
      v += x[i] * w[e * D + i];
      mag += std::abs(x[i]) * std::abs(w[e * D + i]);
    }
    l[e] = v;
    dl = std::max(dl, u_store * std::abs(v) + u_prod * mag);
  }
  return dl;
}

struct Units {
  double store, prod;  // u_store, and 2 u_mul + (D + E) u_acc
};

Units units(index_t E, index_t D, Precision p) {
  // the logits' storage, tf32's products and the accumulation
  const double u_store = unit_roundoff(p == Precision::tf32 ? Precision::fp32 : storage_format(p));
  const double u_mul = p == Precision::tf32 ? unit_roundoff(Precision::tf32) : 0.0;
  const double u_acc = unit_roundoff(p == Precision::fp64 ? Precision::fp64 : Precision::fp32);
  return {u_store, 2 * u_mul + static_cast<double>(D + E) * u_acc};
}

}  // namespace

double selection_sensitivity(const RouterSpec& router, const double* l) {
  const index_t E = router.experts;
  const bool logits_choose = router.order == RouterOrder::topk_then_score;
  const double groups = router.groups > 1 && router.group_score == GroupScore::top2_sum ? 2 : 1;
  double c = 2;
  if (!logits_choose && router.scoring == RouterScoring::sigmoid) c = 0.5;
  if (!logits_choose && router.scoring == RouterScoring::softmax) {
    // the largest softmax probability: exp(0) over the sum
    const double top = *std::max_element(l, l + E);
    double sum = 0;
    for (index_t e = 0; e < E; ++e) sum += std::exp(l[e] - top);
    c = 4 / sum;
  }
  return groups * c;
}

double margin_tolerance(const RouterSpec& router, double c, double dl) {
  return 2 * (c * dl + (static_cast<double>(router.experts) + 4) * unit_roundoff(Precision::fp32));
}

std::vector<double> gate_rounding(const RouterSpec& router, const double* x, const double* w,
                                  const double* b, index_t tokens, index_t d_model, Precision p) {
  const index_t E = router.experts, D = d_model;
  const Units u = units(E, D, p);
  std::vector<double> dl(static_cast<std::size_t>(std::max<index_t>(tokens, 0)), 0.0);
  std::vector<double> l(static_cast<std::size_t>(E));
  for (index_t t = 0; t < tokens; ++t)
    dl[static_cast<std::size_t>(t)] =
        token_logits(x + t * D, w, b, E, D, u.store, u.prod, l.data());
  return dl;
}

std::vector<double> routing_tolerance(const RouterSpec& router, const double* x, const double* w,
                                      const double* b, index_t tokens, index_t d_model,
                                      Precision p) {
  const index_t E = router.experts, D = d_model;
  const Units u = units(E, D, p);
  std::vector<double> tol(static_cast<std::size_t>(std::max<index_t>(tokens, 0)), 0.0);
  std::vector<double> l(static_cast<std::size_t>(E));
  for (index_t t = 0; t < tokens; ++t) {
    const double dl = token_logits(x + t * D, w, b, E, D, u.store, u.prod, l.data());
    tol[static_cast<std::size_t>(t)] =
        margin_tolerance(router, selection_sensitivity(router, l.data()), dl);
  }
  return tol;
}

}  // namespace teo::golden::detail
