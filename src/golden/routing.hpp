// How far a backend's rounding can move a router's choice (docs/golden-format.md, "Routing"):
// the generator keeps every drawn token's selection margin above it, and the checker calls a
// token whose routing differs within it ambiguous rather than wrong.
#pragma once

#include <vector>

#include "teo/layers/moe_router.hpp"
#include "teo/precision.hpp"
#include "teo/types.hpp"

namespace teo::golden::detail {

// For each of T tokens, the most a backend computing the gate's logits l = x W^T + b in
// precision p, and scoring them in float32 at least, can move its selection margin (in
// selection-score units):
//   tol = 2 (c * dl + (E + 4) u32),  dl = max_e (u_store |l_e| + (2 u_mul + (D + E) u_acc) L_e),
// with L_e = sum_i |x_i| |W_ei| + |b_e| the product's magnitude, u_store the unit roundoff the
// logits are stored in, u_mul tf32's for its products, u_acc the accumulation's (float32, or
// float64 for fp64), u32 = 2^-24 (the scoring's); c bounds how a logit error moves a difference
// of two selection scores: 4 max_e p_e for softmax scores p, 1/2 for sigmoid scores, 2 for
// logits (topk_then_score), each doubled when groups choose by the sum of their top two.
// b may be null.
std::vector<double> routing_tolerance(const RouterSpec& router, const double* x, const double* w,
                                      const double* b, index_t tokens, index_t d_model,
                                      Precision p);

// c of the tolerance above for one token whose logits are l (E): how far a logit error of 1 can
// move a difference of two of its selection scores (doubled with top-2-sum groups).
double selection_sensitivity(const RouterSpec& router, const double* l);

// The tolerance of a token whose logits may be off by dl each: 2 (c dl + (E + 4) u32).
double margin_tolerance(const RouterSpec& router, double c, double dl);

// dl of routing_tolerance for each of T tokens: the logits' own rounding in precision p when the
// input x is exact.
std::vector<double> gate_rounding(const RouterSpec& router, const double* x, const double* w,
                                  const double* b, index_t tokens, index_t d_model, Precision p);

}  // namespace teo::golden::detail
