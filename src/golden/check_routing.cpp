// The checker's routing judgement (golden/check_routing.hpp).
#include "golden/check_routing.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include "golden/routing.hpp"
#include "teo/layers/moe.hpp"

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

namespace {

// Whether candidate c of the chosen experts g can be compared: there, integers, of g's shape;
// otherwise r says why not.
bool comparable_ids(TensorResult& r, const safetensors::Tensor& g, const safetensors::Tensor* c) {
  r.name = g.name;
  if (!c) {
    r.status = Status::not_checked;
    r.message = "not in the candidate";
    return false;
  }
  if (c->dtype != DType::I32 && c->dtype != DType::I64) {
    r.status = Status::fail;
    r.mismatch = std::string("dtype ") + safetensors::dtype_name(c->dtype) + " (not I32 or I64)";
    r.message = "the experts chosen are integers: I32 (or I64), not " +
                std::string(safetensors::dtype_name(c->dtype));
    return false;
  }
  if (c->shape != g.shape) {
    r.status = Status::fail;
    r.message = "shape mismatch: candidate " + c->shape_str() + ", golden " + g.shape_str();
    r.mismatch = r.message;
    return false;
  }
  r.compared = true;
  return true;
}

// How one routed tensor's rows are judged: the golden's margins, each row's tolerance, and
// whether its routing was given.
struct RowRule {
  const RouterSpec& router;
  const std::vector<double>& margin;
  std::function<double(index_t)> tolerance;
  std::function<std::vector<double>(index_t)> selection;  // a row's selection scores
  bool replayed = false;
  const char* row = "token";  // what a row is, in the messages
  std::string layer;          // AmbiguousToken::layer
  // why a routing is wrong when it is replayed, and what replays it otherwise
  std::string replayed_why = "the routing was given: input.moe.topk_ids";
  std::string given = "input.moe.topk_ids";
};

// Judges candidate ids ci against the golden's gi row by row (k per row): equal, ambiguous (the
// rule's tolerance explains the difference), or wrong; r's status and message say which.
void judge_rows(TensorResult& r, const std::vector<std::int64_t>& gi,
                const std::vector<std::int64_t>& ci, const RowRule& rule,
                std::vector<AmbiguousToken>& ambiguous, std::set<std::int64_t>& rows, Precision p) {
  const index_t k = rule.router.top_k,
                T = static_cast<index_t>(gi.size()) / std::max<index_t>(k, 1);
  const auto row = [&](const std::vector<std::int64_t>& v, index_t t) {
    return std::vector<std::int64_t>(v.begin() + t * k, v.begin() + (t + 1) * k);
  };
  std::int64_t wrong = 0, first_wrong = -1;
  double first_tol = 0;
  const std::size_t before = ambiguous.size();
  for (index_t t = 0; t < T; ++t) {
    const auto gr = row(gi, t), cr = row(ci, t);
    if (gr == cr) continue;
    const auto i = static_cast<std::size_t>(t);
    const double tol = rule.tolerance(t);
    if (!rule.replayed && rule.margin[i] > 0 && rule.margin[i] <= tol &&
        within_tolerance(rule.router, rule.selection(t), cr, tol)) {
      ambiguous.push_back({rule.layer, t, rule.margin[i], tol, gr, cr});
      rows.insert(t);
      continue;
    }
    if (first_wrong < 0) {
      first_wrong = t;
      first_tol = tol;
    }
    ++wrong;
  }
  const auto found = static_cast<std::int64_t>(ambiguous.size() - before);
  r.max_abs = static_cast<double>(wrong + found);
  r.max_rel = T > 0 ? r.max_abs / static_cast<double>(T) : 0;
  const std::string what = rule.row;
  if (wrong > 0) {
    const auto i = static_cast<std::size_t>(first_wrong);
    r.status = Status::fail;
    r.ratio = INFINITY;
    r.message =
        std::to_string(wrong) + " " + what + "(s) routed to a wrong expert; first " + what + " " +
        std::to_string(first_wrong) + ": candidate " + ids_str(row(ci, first_wrong)) + ", golden " +
        ids_str(row(gi, first_wrong)) +
        (rule.replayed ? " (" + rule.replayed_why + ")"
         : rule.margin[i] > first_tol
             ? " (margin " + full_digits(rule.margin[i]) + ", above the " + to_string(p) +
                   " tolerance " + full_digits(first_tol) + ")"
             : " (no top-k choice of the golden's selection scores moved by the " +
                   std::string(to_string(p)) + " tolerance " + full_digits(first_tol) + ")");
    return;
  }
  if (found > 0) {
    const auto& a = ambiguous[before];
    std::set<std::int64_t> mine;
    for (std::size_t n = before; n < ambiguous.size(); ++n) mine.insert(ambiguous[n].token);
    r.status = Status::ambiguous;
    r.message = std::to_string(found) + " " + what + "(s) routed otherwise within the " +
                to_string(p) + " tolerance (" + tokens_str(mine) + "; " + what + " " +
                std::to_string(a.token) + ": candidate " + ids_str(a.candidate) + ", golden " +
                ids_str(a.golden) + ", margin " + full_digits(a.margin) +
                " <= " + full_digits(a.tolerance) + "): judge the experts with router replay (" +
                rule.given + ")";
    return;
  }
  r.status = Status::pass;
}

}  // namespace

RoutingJudgement judge_routing(const File& golden, const File& candidate,
                               const detail::RoutedCase& rc, bool f32, Precision p) {
  RoutingJudgement j;
  TensorResult& r = j.ids;
  const auto* g = golden.find("output.topk_ids");
  const auto* c = candidate.find("output.topk_ids");
  if (!comparable_ids(r, *g, c)) return j;
  const auto gi = g->int_values(), ci = c->int_values();
  const index_t T = rc.tokens, D = rc.d_model;
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
  const RowRule rule{
      .router = rc.router,
      .margin = margin,
      .tolerance = [&](index_t t) { return tol[static_cast<std::size_t>(t)]; },
      .selection = [&](index_t t) { return selection_scores(rc.router, logits, corr, t); },
      .replayed = rc.replayed,
      .row = "token",
      .layer = "",
      .replayed_why = "the routing was given: input.moe.topk_ids",
      .given = "input.moe.topk_ids"};
  judge_rows(r, gi, ci, rule, j.ambiguous, j.rows, p);
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

namespace {

// What one MoE layer's tolerances are made of, from the golden alone.
struct LayerRouting {
  RouterSpec router;
  index_t positions = 0;
  std::vector<double> logits, correction;  // the truth's (N, E), and the selection bias (E)
  std::vector<double> margin;              // the truth's selection margins (N)
  std::vector<double> c;                   // each position's sensitivity
  std::vector<double> floor;               // the gate product's rounding in p
  std::vector<double> estimate;            // kModelRoutingK times the run's logit error
  bool replayed = false;
};

std::string moe_name(index_t layer, const char* what) {
  return "act.layers." + std::to_string(layer) + ".moe." + what;
}

// max_e |a - b| of each of the rows of E.
std::vector<double> row_errors(const std::vector<double>& a, const std::vector<double>& b,
                               index_t E) {
  std::vector<double> out(E > 0 ? a.size() / static_cast<std::size_t>(E) : 0, 0.0);
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    auto& o = out[i / static_cast<std::size_t>(E)];
    o = std::max(o, std::abs(a[i] - b[i]));
  }
  return out;
}

// Layer i's routing data, or nothing when the golden keeps no logits for it.
std::optional<LayerRouting> layer_routing(const File& golden, const ModelConfig& cfg, index_t i,
                                          bool f32, Precision p,
                                          const std::map<std::string, std::vector<double>>& emu) {
  const std::string logits_name = moe_name(i, "logits");
  const auto* g = golden.find(logits_name);
  if (!g) return std::nullopt;
  LayerRouting d;
  d.router = moe_spec(cfg.ffn.moe, cfg.d_model).router;
  const index_t E = d.router.experts, D = cfg.d_model;
  d.logits = truth_of(golden, *g, f32);
  d.positions = static_cast<index_t>(d.logits.size()) / E;
  const std::string param = "param.layers." + std::to_string(i) + ".moe.gate.";
  const auto values = [&](const std::string& n) {
    const auto* t = golden.find(n);
    return t ? t->float_values() : std::vector<double>();
  };
  d.correction = values(param + "e_score_correction_bias");
  Routing<double> r;
  route(d.router, d.logits.data(), d.correction.empty() ? nullptr : d.correction.data(), nullptr,
        d.positions, r);
  d.margin = r.margin;
  for (index_t t = 0; t < d.positions; ++t)
    d.c.push_back(selection_sensitivity(d.router, d.logits.data() + t * E));
  const std::string in_name =
      "act.layers." + std::to_string(i) + (cfg.norms.norm_first ? ".norm2" : ".norm1");
  const auto w = values(param + "weight"), b = values(param + "bias");
  if (const auto* x = golden.find(in_name); x && !w.empty()) {
    const auto xv = truth_of(golden, *x, f32);
    d.floor = gate_rounding(d.router, xv.data(), w.data(), b.empty() ? nullptr : b.data(),
                            d.positions, D, p);
  } else {
    d.floor.assign(static_cast<std::size_t>(d.positions), 0.0);
  }
  if (const auto it = emu.find(logits_name); it != emu.end()) {
    d.estimate = row_errors(it->second, d.logits, E);
  } else if (f32) {
    d.estimate = row_errors(g->float_values(), d.logits, E);
  } else {
    d.estimate.assign(static_cast<std::size_t>(d.positions), 0.0);
  }
  for (auto& e : d.estimate) e *= kModelRoutingK;
  d.replayed = golden.find("input.layers." + std::to_string(i) + ".moe.topk_ids") != nullptr;
  return d;
}

}  // namespace

ModelRoutingJudgement judge_model_routing(const File& golden, const File& candidate,
                                          const ModelConfig& cfg, bool f32, Precision p,
                                          const std::map<std::string, std::vector<double>>& emu) {
  ModelRoutingJudgement j;
  for (index_t i = 0; i < cfg.num_layers; ++i) {
    const std::string name = moe_name(i, "topk_ids");
    const auto* g = cfg.moe_layer(i) ? golden.find(name) : nullptr;
    if (!g) continue;
    TensorResult& r = j.ids[name];
    r.name = name;
    if (j.first_layer >= 0) {
      r.status = Status::ambiguous;
      r.message = "not judged: it depends on the routing of the ambiguous position(s) " +
                  tokens_str(j.rows) + " of layer " + std::to_string(j.first_layer);
      continue;
    }
    const auto* c = candidate.find(name);
    if (!comparable_ids(r, *g, c)) continue;
    const auto d = layer_routing(golden, cfg, i, f32, p, emu);
    const auto gi = g->int_values(), ci = c->int_values();
    if (!d) {
      // no logits kept: the routing is judged exactly, with no margin to call it ambiguous
      const std::vector<double> none(gi.size(), INFINITY);
      const RouterSpec router = moe_spec(cfg.ffn.moe, cfg.d_model).router;
      const RowRule exact{.router = router,
                          .margin = none,
                          .tolerance = [](index_t) { return 0.0; },
                          .selection = [](index_t) { return std::vector<double>(); },
                          .replayed = true,
                          .row = "position",
                          .layer = "layers." + std::to_string(i),
                          .replayed_why = "judged exactly: the golden keeps no " +
                                          moe_name(i, "logits") + " to tell a near tie by",
                          .given = ""};
      std::set<std::int64_t> rows;
      judge_rows(r, gi, ci, exact, j.ambiguous, rows, p);
      continue;
    }
    // the candidate's own logit error where it gives its logits, else the estimate
    std::vector<double> err = d->estimate;
    if (const auto* cl = candidate.find(moe_name(i, "logits"));
        cl && safetensors::is_float(cl->dtype) &&
        cl->shape == golden.find(moe_name(i, "logits"))->shape) {
      err = row_errors(cl->float_values(), d->logits, d->router.experts);
    }
    const std::string layer = "layers." + std::to_string(i);
    const RowRule rule{
        .router = d->router,
        .margin = d->margin,
        .tolerance =
            [&](index_t t) {
              const auto at = static_cast<std::size_t>(t);
              return margin_tolerance(d->router, d->c[at], std::max(err[at], d->floor[at]));
            },
        .selection =
            [&](index_t t) { return selection_scores(d->router, d->logits, d->correction, t); },
        .replayed = d->replayed,
        .row = "position",
        .layer = layer,
        .replayed_why = "the routing was given: input." + layer + ".moe.topk_ids",
        .given = "input." + layer + ".moe.topk_ids"};
    std::set<std::int64_t> rows;
    judge_rows(r, gi, ci, rule, j.ambiguous, rows, p);
    if (!rows.empty()) {
      j.first_layer = i;
      j.rows = std::move(rows);
    }
  }
  return j;
}

bool after_routing(const std::string& name, index_t layer, const ModelConfig& cfg) {
  if (name.starts_with("grad.") || name.starts_with("act.generate.")) return true;
  if (!name.starts_with("act.")) return false;
  const std::string n = name.substr(4);
  if (!n.starts_with("layers.")) {
    for (const char* before : {"embedding", "positional", "token_type", "embedding_norm", "input"})
      if (n == before) return false;
    return true;  // the top of the model and the loss terms
  }
  const auto dot = n.find('.', 7);
  const index_t j = std::stoll(n.substr(7, dot - 7));
  if (j != layer) return j > layer;
  const std::string rest = n.substr(dot + 1);
  for (const char* after :
       {"moe.topk_ids", "moe.topk_weights", "moe.expert_offsets", "moe.source_rows",
        "moe.expert_in", "moe.expert_hidden", "moe.expert_out", "ffn_out", "residual2", "output"})
    if (rest == after) return true;
  return rest == "norm2" && !cfg.norms.norm_first;  // post-norm: after the residual
}

std::vector<UnclearPosition> unclear_routing(
    const File& golden, const ModelConfig& cfg, bool f32, Precision p,
    const std::map<std::string, std::vector<double>>& emu) {
  std::vector<UnclearPosition> out;
  for (index_t i = 0; i < cfg.num_layers; ++i) {
    if (!cfg.moe_layer(i)) continue;
    const auto d = layer_routing(golden, cfg, i, f32, p, emu);
    if (!d) continue;
    for (index_t t = 0; t < d->positions; ++t) {
      const auto at = static_cast<std::size_t>(t);
      const double tol =
          margin_tolerance(d->router, d->c[at], std::max(d->estimate[at], d->floor[at]));
      if (!(d->margin[at] > 2 * tol)) out.push_back({i, t, d->margin[at], tol});
    }
  }
  return out;
}

}  // namespace teo::golden::detail
