// The mixture-of-experts router (include/teo/layers/moe_router.hpp). Plain loops in a fixed order:
// the same bits on every thread count and ISA.
#include "teo/layers/moe_router.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "layers/logistic.hpp"

namespace teo {

void RouterSpec::validate() const {
  detail::validate_router_keys(experts, top_k, groups, topk_groups, group_score,
                               routed_scaling_factor);
}

namespace {

using detail::sigmoid;

// softmax of n values into y, summed in index order.
template <class Real>
void softmax_of(const Real* x, index_t n, Real* y) {
  Real m = x[0];
  for (index_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  Real sum = 0;
  for (index_t i = 0; i < n; ++i) sum += (y[i] = std::exp(x[i] - m));
  for (index_t i = 0; i < n; ++i) y[i] /= sum;
}

// Whether a ranks before b: the larger value, then the lower index.
template <class Real>
bool before(const Real* v, index_t a, index_t b) {
  return v[a] > v[b] || (v[a] == v[b] && a < b);
}

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

template <class Real>
void route(const RouterSpec& spec, const Real* logits, const Real* correction,
           const std::int32_t* replay, index_t tokens, Routing<Real>& out) {
  spec.validate();
  const index_t E = spec.experts, k = spec.top_k, G = spec.groups, per = E / G;
  const auto at = [](index_t i) { return static_cast<std::size_t>(i); };
  out.scores.assign(at(tokens * E), Real(0));
  out.ids.assign(at(tokens * k), 0);
  out.weights.assign(at(tokens * k), Real(0));
  out.margin.assign(at(tokens), Real(0));
  std::vector<Real> sel(at(E)), group(at(G)), pre(at(k));
  std::vector<index_t> order(at(E)), gorder(at(G));
  std::vector<char> eligible(at(E));
  for (index_t t = 0; t < tokens; ++t) {
    const Real* l = logits + t * E;
    for (index_t e = 0; e < E; ++e) {
      if (!std::isfinite(l[e])) {
        throw RangeError("router logit (" + std::to_string(t) + ", " + std::to_string(e) +
                         ") is not finite");
      }
    }
    Real* s = out.scores.data() + t * E;
    const bool score_first = spec.order == RouterOrder::score_then_topk;
    if (score_first) {
      if (spec.scoring == RouterScoring::softmax) {
        softmax_of(l, E, s);
      } else {
        for (index_t e = 0; e < E; ++e) s[e] = sigmoid(l[e]);
      }
    }
    for (index_t e = 0; e < E; ++e)
      sel[at(e)] = (score_first ? s[e] : l[e]) + (correction ? correction[e] : Real(0));
    // group-limited choice: the topk_groups best groups
    Real group_margin = Real(kInf);
    std::fill(eligible.begin(), eligible.end(), char(G == 1));
    if (G > 1) {
      for (index_t g = 0; g < G; ++g) {
        std::iota(order.begin(), order.begin() + per, g * per);
        std::sort(order.begin(), order.begin() + per,
                  [&](index_t a, index_t b) { return before(sel.data(), a, b); });
        group[at(g)] = spec.group_score == GroupScore::max ? sel[at(order[0])]
                                                           : sel[at(order[0])] + sel[at(order[1])];
      }
      std::iota(gorder.begin(), gorder.end(), index_t{0});
      std::sort(gorder.begin(), gorder.end(),
                [&](index_t a, index_t b) { return before(group.data(), a, b); });
      for (index_t i = 0; i < spec.topk_groups; ++i)
        for (index_t e = gorder[at(i)] * per; e < (gorder[at(i)] + 1) * per; ++e)
          eligible[at(e)] = 1;
      if (spec.topk_groups < G)
        group_margin =
            group[at(gorder[at(spec.topk_groups - 1)])] - group[at(gorder[at(spec.topk_groups)])];
    }
    // the eligible experts, best first
    index_t n = 0;
    for (index_t e = 0; e < E; ++e)
      if (eligible[at(e)]) order[at(n++)] = e;
    std::sort(order.begin(), order.begin() + n,
              [&](index_t a, index_t b) { return before(sel.data(), a, b); });
    std::int32_t* ids = out.ids.data() + t * k;
    if (replay) {
      for (index_t j = 0; j < k; ++j) {
        const std::int32_t id = replay[t * k + j];
        if (id < 0 || id >= E || !eligible[at(id)] || std::find(ids, ids + j, id) != ids + j) {
          throw ConfigError("replayed topk_ids (" + std::to_string(t) + ", " + std::to_string(j) +
                            ") = " + std::to_string(id) +
                            " is not an eligible expert of its token, or repeats one");
        }
        ids[j] = id;
      }
    } else {
      for (index_t j = 0; j < k; ++j) ids[j] = static_cast<std::int32_t>(order[at(j)]);
    }
    // the margin: each chosen against the next (the order of ids), and the worst chosen against
    // the best not chosen
    Real worst_in = Real(kInf), best_out = -Real(kInf), order_gap = Real(kInf);
    for (index_t j = 0; j < k; ++j) worst_in = std::min(worst_in, sel[at(ids[j])]);
    for (index_t j = 0; j + 1 < k; ++j)
      order_gap = std::min(order_gap, sel[at(ids[j])] - sel[at(ids[j + 1])]);
    for (index_t i = 0; i < n; ++i) {
      const index_t e = order[at(i)];
      if (std::find(ids, ids + k, static_cast<std::int32_t>(e)) == ids + k) {
        best_out = sel[at(e)];
        break;
      }
    }
    out.margin[at(t)] = std::min({worst_in - best_out, order_gap, group_margin});
    // the weights
    if (score_first) {
      for (index_t j = 0; j < k; ++j) pre[at(j)] = s[ids[j]];
    } else {
      for (index_t j = 0; j < k; ++j) pre[at(j)] = l[ids[j]];
      if (spec.scoring == RouterScoring::softmax) {
        softmax_of(pre.data(), k, pre.data());
      } else {
        for (index_t j = 0; j < k; ++j) pre[at(j)] = sigmoid(pre[at(j)]);
      }
      for (index_t j = 0; j < k; ++j) s[ids[j]] = pre[at(j)];
    }
    Real sum = 0;
    for (index_t j = 0; j < k; ++j) sum += pre[at(j)];
    const auto factor = static_cast<Real>(spec.routed_scaling_factor);
    for (index_t j = 0; j < k; ++j) {
      const Real w = spec.norm_topk_prob ? pre[at(j)] / sum : pre[at(j)];
      out.weights[at(t * k + j)] = w * factor;
    }
  }
}

template <class Real>
void route_backward(const RouterSpec& spec, const Routing<Real>& r, const Real* dweights,
                    index_t tokens, Real* dlogits) {
  const index_t E = spec.experts, k = spec.top_k;
  const auto at = [](index_t i) { return static_cast<std::size_t>(i); };
  const auto factor = static_cast<Real>(spec.routed_scaling_factor);
  std::vector<Real> pre(at(k)), dpre(at(k)), ds(at(E));
  for (index_t t = 0; t < tokens; ++t) {
    const Real* s = r.scores.data() + t * E;
    const std::int32_t* ids = r.ids.data() + t * k;
    Real* dl = dlogits + t * E;
    std::fill(dl, dl + E, Real(0));
    for (index_t j = 0; j < k; ++j) pre[at(j)] = s[ids[j]];
    // through the scaling and the renormalisation: w_j = f p_j / S, S = sum p
    Real sum = 0, gw = 0;
    for (index_t j = 0; j < k; ++j) sum += pre[at(j)];
    for (index_t j = 0; j < k; ++j) dpre[at(j)] = dweights[t * k + j] * factor;
    if (spec.norm_topk_prob) {
      for (index_t j = 0; j < k; ++j) gw += dpre[at(j)] * (pre[at(j)] / sum);
      for (index_t j = 0; j < k; ++j) dpre[at(j)] = (dpre[at(j)] - gw) / sum;
    }
    if (spec.order == RouterOrder::score_then_topk) {
      std::fill(ds.begin(), ds.end(), Real(0));
      for (index_t j = 0; j < k; ++j) ds[at(ids[j])] = dpre[at(j)];
      if (spec.scoring == RouterScoring::softmax) {
        Real dot = 0;
        for (index_t e = 0; e < E; ++e) dot += s[e] * ds[at(e)];
        for (index_t e = 0; e < E; ++e) dl[e] = s[e] * (ds[at(e)] - dot);
      } else {
        for (index_t e = 0; e < E; ++e) dl[e] = ds[at(e)] * s[e] * (Real(1) - s[e]);
      }
    } else if (spec.scoring == RouterScoring::softmax) {
      Real dot = 0;
      for (index_t j = 0; j < k; ++j) dot += pre[at(j)] * dpre[at(j)];
      for (index_t j = 0; j < k; ++j) dl[ids[j]] = pre[at(j)] * (dpre[at(j)] - dot);
    } else {
      for (index_t j = 0; j < k; ++j)
        dl[ids[j]] = dpre[at(j)] * pre[at(j)] * (Real(1) - pre[at(j)]);
    }
  }
}

template <class Real>
Real load_balancing_loss(const Real* logits, const std::int32_t* ids, index_t tokens,
                         index_t experts, index_t top_k) {
  if (tokens == 0) return Real(0);
  const auto at = [](index_t i) { return static_cast<std::size_t>(i); };
  std::vector<Real> p(at(experts)), mean_p(at(experts), Real(0)), count(at(experts), Real(0));
  for (index_t t = 0; t < tokens; ++t) {
    softmax_of(logits + t * experts, experts, p.data());
    for (index_t e = 0; e < experts; ++e) mean_p[at(e)] += p[at(e)];
    for (index_t j = 0; j < top_k; ++j) count[at(ids[t * top_k + j])] += Real(1);
  }
  const auto T = static_cast<Real>(tokens);
  Real loss = 0;
  for (index_t e = 0; e < experts; ++e) loss += (count[at(e)] / T) * (mean_p[at(e)] / T);
  return static_cast<Real>(experts) * loss;
}

template <class Real>
void load_balancing_loss_backward(const Real* logits, const std::int32_t* ids, index_t tokens,
                                  index_t experts, index_t top_k, Real dloss, Real* dlogits) {
  if (tokens == 0) return;
  const auto at = [](index_t i) { return static_cast<std::size_t>(i); };
  std::vector<Real> count(at(experts), Real(0)), p(at(experts)), dp(at(experts));
  for (index_t t = 0; t < tokens * top_k; ++t) count[at(ids[t])] += Real(1);
  const auto T = static_cast<Real>(tokens);
  // d loss / d p_te = E f_e / T
  for (index_t e = 0; e < experts; ++e)
    dp[at(e)] = dloss * static_cast<Real>(experts) * (count[at(e)] / T) / T;
  for (index_t t = 0; t < tokens; ++t) {
    softmax_of(logits + t * experts, experts, p.data());
    Real dot = 0;
    for (index_t e = 0; e < experts; ++e) dot += p[at(e)] * dp[at(e)];
    for (index_t e = 0; e < experts; ++e) dlogits[t * experts + e] += p[at(e)] * (dp[at(e)] - dot);
  }
}

namespace {
template <class Real>
Real logsumexp(const Real* x, index_t n) {
  Real m = x[0];
  for (index_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  Real sum = 0;
  for (index_t i = 0; i < n; ++i) sum += std::exp(x[i] - m);
  return m + std::log(sum);
}
}  // namespace

template <class Real>
Real router_z_loss(const Real* logits, index_t tokens, index_t experts) {
  if (tokens == 0) return Real(0);
  Real sum = 0;
  for (index_t t = 0; t < tokens; ++t) {
    const Real z = logsumexp(logits + t * experts, experts);
    sum += z * z;
  }
  return sum / static_cast<Real>(tokens);
}

template <class Real>
void router_z_loss_backward(const Real* logits, index_t tokens, index_t experts, Real dloss,
                            Real* dlogits) {
  if (tokens == 0) return;
  std::vector<Real> p(static_cast<std::size_t>(experts));
  const Real c = dloss * Real(2) / static_cast<Real>(tokens);
  for (index_t t = 0; t < tokens; ++t) {
    const Real z = logsumexp(logits + t * experts, experts);
    softmax_of(logits + t * experts, experts, p.data());
    for (index_t e = 0; e < experts; ++e)
      dlogits[t * experts + e] += c * z * p[static_cast<std::size_t>(e)];
  }
}

#define TEO_ROUTER(Real)                                                                      \
  template void route<Real>(const RouterSpec&, const Real*, const Real*, const std::int32_t*, \
                            index_t, Routing<Real>&);                                         \
  template void route_backward<Real>(const RouterSpec&, const Routing<Real>&, const Real*,    \
                                     index_t, Real*);                                         \
  template Real load_balancing_loss<Real>(const Real*, const std::int32_t*, index_t, index_t, \
                                          index_t);                                           \
  template void load_balancing_loss_backward<Real>(const Real*, const std::int32_t*, index_t, \
                                                   index_t, index_t, Real, Real*);            \
  template Real router_z_loss<Real>(const Real*, index_t, index_t);                           \
  template void router_z_loss_backward<Real>(const Real*, index_t, index_t, Real, Real*);
TEO_ROUTER(float)
TEO_ROUTER(double)
#undef TEO_ROUTER

}  // namespace teo
