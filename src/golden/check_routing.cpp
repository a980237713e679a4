// The checker's routing judgement (golden/check_routing.hpp).
#include "golden/check_routing.hpp"

#include <algorithm>
#include <cmath>

#include "golden/routing.hpp"

namespace teo::golden::detail {

using safetensors::DType;
using safetensors::File;

namespace {

std::string ids_str(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Whether the candidate's choice `c` for one token is a top-k choice (in order) of the selection
// scores `sel` (E) moved by at most `tol` each way: each chosen at least the next less tol, the
// last chosen at least every other expert of the groups it chose from less tol, and with groups
// each group chosen from at least the topk_groups-th best group's score less twice tol.
bool within_tolerance(const RouterSpec& r, const std::vector<double>& sel,
                      const std::vector<std::int64_t>& c, double tol) {
  const index_t E = r.experts, per = E / r.groups;
  std::set<std::int64_t> chosen, groups;
  for (auto e : c) {
    if (e < 0 || e >= E || !chosen.insert(e).second) return false;
    groups.insert(e / per);
  }
  const auto s = [&](std::int64_t e) { return sel[static_cast<std::size_t>(e)]; };
  for (std::size_t j = 0; j + 1 < c.size(); ++j)
    if (s(c[j]) < s(c[j + 1]) - tol) return false;
  for (index_t e = 0; e < E; ++e)
    if (!chosen.contains(e) && groups.contains(e / per) && s(c.back()) < s(e) - tol) return false;
  if (r.groups > 1) {
    if (static_cast<index_t>(groups.size()) > r.topk_groups) return false;
    std::vector<double> score(static_cast<std::size_t>(r.groups));
    for (index_t g = 0; g < r.groups; ++g) {
      std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      score[static_cast<std::size_t>(g)] =
          r.group_score == GroupScore::max || per < 2 ? v[0] : v[0] + v[1];
    }
    std::vector<double> sorted = score;
    std::sort(sorted.rbegin(), sorted.rend());
    const double cut = sorted[static_cast<std::size_t>(r.topk_groups - 1)];
    for (auto g : groups)
      if (score[static_cast<std::size_t>(g)] < cut - 2 * tol) return false;
  }
  return true;
}

// The selection scores of token t (E): the scores (score_then_topk) or the logits, plus the
// correction bias.
std::vector<double> selection_scores(const RouterSpec& r, const std::vector<double>& logits,
                                     const std::vector<double>& correction, index_t t) {
  const index_t E = r.experts;
  std::vector<double> s(logits.begin() + t * E, logits.begin() + (t + 1) * E);
  if (r.order == RouterOrder::score_then_topk) {
    if (r.scoring == RouterScoring::sigmoid) {
      for (auto& v : s) v = 1 / (1 + std::exp(-v));
    } else {
      const double top = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (auto& v : s) sum += (v = std::exp(v - top));
      for (auto& v : s) v /= sum;
    }
  }
  for (std::size_t e = 0; e < correction.size(); ++e) s[e] += correction[e];
  return s;
}

}  // namespace

TensorResult judge_exact_ints(const safetensors::Tensor& g, const safetensors::Tensor* c) {
  TensorResult r;
  r.name = g.name;
  if (!c) {
    r.status = Status::not_checked;
    r.message = "not in the candidate";
    return r;
  }
  if (c->dtype != DType::I32 && c->dtype != DType::I64) {
    r.status = Status::fail;
    r.mismatch = std::string("dtype ") + safetensors::dtype_name(c->dtype) + " (not I32 or I64)";
    r.message =
        "an integer result: I32 (or I64), not " + std::string(safetensors::dtype_name(c->dtype));
    return r;
  }
  if (c->shape != g.shape) {
    r.status = Status::fail;
    r.message = "shape mismatch: candidate " + c->shape_str() + ", golden " + g.shape_str();
    r.mismatch = r.message;
    return r;
  }
  r.compared = true;
  const auto gv = g.int_values(), cv = c->int_values();
  std::int64_t wrong = 0, first = -1;
  for (std::size_t i = 0; i < gv.size(); ++i) {
    if (gv[i] == cv[i]) continue;
    if (first < 0) first = static_cast<std::int64_t>(i);
    ++wrong;
  }
  r.max_abs = static_cast<double>(wrong);
  r.max_rel = gv.empty() ? 0 : r.max_abs / static_cast<double>(gv.size());
  r.status = wrong == 0 ? Status::pass : Status::fail;
  if (wrong > 0) {
    const auto i = static_cast<std::size_t>(first);
    r.ratio = INFINITY;
    r.message = std::to_string(wrong) + " entr" + (wrong == 1 ? "y differs" : "ies differ") +
                "; first at [" + std::to_string(first) + "]: candidate " + std::to_string(cv[i]) +
                ", golden " + std::to_string(gv[i]);
  }
  return r;
}

std::string tokens_str(const std::set<std::int64_t>& rows) {
  std::string s;
  int n = 0;
  for (auto t : rows) {
    if (++n > 8) return s + ", ...";
    s += (s.empty() ? "" : ", ") + std::to_string(t);
  }
  return s;
}

RoutingJudgement judge_routing(const File& golden, const File& candidate,
                               const detail::RoutedCase& rc, bool f32, Precision p) {
  RoutingJudgement j;
  TensorResult& r = j.ids;
  const auto* g = golden.find("output.topk_ids");
  const auto* c = candidate.find("output.topk_ids");
  r.name = "output.topk_ids";
  if (!c) {
    r.status = Status::not_checked;
    r.message = "not in the candidate";
    return j;
  }
  if (c->dtype != DType::I32 && c->dtype != DType::I64) {
    r.status = Status::fail;
    r.mismatch = std::string("dtype ") + safetensors::dtype_name(c->dtype) + " (not I32 or I64)";
    r.message = "the experts chosen are integers: I32 (or I64), not " +
                std::string(safetensors::dtype_name(c->dtype));
    return j;
  }
  if (c->shape != g->shape) {
    r.status = Status::fail;
    r.message = "shape mismatch: candidate " + c->shape_str() + ", golden " + g->shape_str();
    r.mismatch = r.message;
    return j;
  }
  r.compared = true;
  const auto gi = g->int_values(), ci = c->int_values();
  const index_t T = rc.tokens, k = rc.router.top_k, D = rc.d_model;
  const auto value_of = [&](const char* name) {
    const auto* t = golden.find(name);
    return t ? detail::truth_of(golden, *t,
                                f32 && !std::string_view(name).starts_with("input.") &&
                                    !std::string_view(name).starts_with("param."))
             : std::vector<double>();
  };
  const auto x = value_of("input.x"), w = value_of("param.gate.weight");
  const auto b = value_of("param.gate.bias"), margin = value_of("output.selection_margin");
  const auto logits = value_of("output.logits");
  const auto corr = value_of("param.gate.e_score_correction_bias");
  const auto tol = detail::routing_tolerance(rc.router, x.data(), w.data(),
                                             b.empty() ? nullptr : b.data(), T, D, p);
  std::int64_t wrong = 0, first_wrong = -1;
  for (index_t t = 0; t < T; ++t) {
    const auto row = [&](const std::vector<std::int64_t>& v) {
      return std::vector<std::int64_t>(v.begin() + t * k, v.begin() + (t + 1) * k);
    };
    const auto gr = row(gi), cr = row(ci);
    if (gr == cr) continue;
    const auto i = static_cast<std::size_t>(t);
    if (!rc.replayed && margin[i] > 0 && margin[i] <= tol[i] &&
        within_tolerance(rc.router, selection_scores(rc.router, logits, corr, t), cr, tol[i])) {
      j.ambiguous.push_back({"", t, margin[i], tol[i], gr, cr});
      j.rows.insert(t);
      continue;
    }
    if (first_wrong < 0) first_wrong = t;
    ++wrong;
  }
  r.max_abs = static_cast<double>(wrong + static_cast<std::int64_t>(j.ambiguous.size()));
  r.max_rel = T > 0 ? r.max_abs / static_cast<double>(T) : 0;
  if (wrong > 0) {
    const auto i = static_cast<std::size_t>(first_wrong);
    const auto row = [&](const std::vector<std::int64_t>& v) {
      return std::vector<std::int64_t>(v.begin() + first_wrong * k,
                                       v.begin() + (first_wrong + 1) * k);
    };
    r.status = Status::fail;
    r.ratio = INFINITY;
    r.message = std::to_string(wrong) + " token(s) routed to a wrong expert; first token " +
                std::to_string(first_wrong) + ": candidate " + ids_str(row(ci)) + ", golden " +
                ids_str(row(gi)) +
                (rc.replayed ? " (the routing was given: input.moe.topk_ids)"
                 : margin[i] > tol[i]
                     ? " (margin " + full_digits(margin[i]) + ", above the " + to_string(p) +
                           " tolerance " + full_digits(tol[i]) + ")"
                     : " (no top-k choice of the golden's selection scores moved by the " +
                           std::string(to_string(p)) + " tolerance " + full_digits(tol[i]) + ")");
    return j;
  }
  if (!j.ambiguous.empty()) {
    const auto& a = j.ambiguous.front();
    r.status = Status::ambiguous;
    r.message = std::to_string(j.ambiguous.size()) + " token(s) routed otherwise within the " +
                to_string(p) + " tolerance (" + tokens_str(j.rows) + "; token " +
                std::to_string(a.token) + ": candidate " + ids_str(a.candidate) + ", golden " +
                ids_str(a.golden) + ", margin " + full_digits(a.margin) +
                " <= " + full_digits(a.tolerance) +
                "): judge the experts with router replay (input.moe.topk_ids)";
    return j;
  }
  r.status = Status::pass;
  return j;
}

safetensors::Tensor without_rows(const safetensors::Tensor& c, const safetensors::Tensor& g,
                                 const std::set<std::int64_t>& rows, DType dtype) {
  auto v = c.float_values();
  const auto gv = g.float_values();
  const std::size_t per =
      c.shape.empty() || c.shape[0] == 0 ? 0 : v.size() / static_cast<std::size_t>(c.shape[0]);
  for (auto t : rows) {
    const auto at = static_cast<std::size_t>(t) * per;
    if (at + per <= v.size()) std::copy_n(gv.begin() + at, per, v.begin() + at);
  }
  File f;
  if (dtype == DType::F32) {
    const std::vector<float> y(v.begin(), v.end());
    f.add<float>(c.name, c.shape, y.data(), y.size());
  } else {
    f.add<double>(c.name, c.shape, v.data(), v.size());
  }
  return std::move(f.tensors.front());
}

}  // namespace teo::golden::detail
