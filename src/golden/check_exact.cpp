// The checker's judgement of an exact float output (golden_internal.hpp, judge_exact).
#include <algorithm>
#include <cmath>

#include "golden_internal.hpp"
#include "teo/golden_ops.hpp"

namespace teo::golden::detail {

using safetensors::DType;
using safetensors::File;

TensorResult judge_exact(const File& golden, const safetensors::Tensor& g,
                         const safetensors::Tensor* c, bool f32, const std::vector<double>* emu) {
  TensorResult r;
  r.name = g.name;
  if (!c) {
    r.status = Status::not_checked;
    r.message = "not in the candidate";
    return r;
  }
  // a float result takes a float candidate; an integer one (int8 codes), an integer or float one
  const bool int_ok = !safetensors::is_float(g.dtype) && c->dtype != DType::U8;
  if ((!safetensors::is_float(c->dtype) && !int_ok) || c->shape != g.shape) {
    r.status = Status::fail;
    r.message = std::string("an exact ") + (int_ok ? "integer" : "float") + " result of shape " +
                g.shape_str() + ", not " + safetensors::dtype_name(c->dtype) + " " + c->shape_str();
    r.mismatch = r.message;
    return r;
  }
  r.compared = true;
  const auto numbers = [](const safetensors::Tensor& t) {
    if (safetensors::is_float(t.dtype)) return t.float_values();
    const auto i = t.int_values();
    return std::vector<double>(i.begin(), i.end());
  };
  const auto cv = numbers(*c);
  const std::vector<double> want = f32 && c->dtype == DType::F64 && safetensors::is_float(g.dtype)
                                       ? truth_of(golden, g, true)
                                       : numbers(g);
  const auto same = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  const auto alt = exact_alternates(golden, g.name);
  std::int64_t wrong = 0, first = -1, ties = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = std::abs(cv[i] - want[i]);
    if (same(cv[i], want[i]) || (emu && same(cv[i], (*emu)[i]))) continue;
    if (!alt.empty() && cv[i] == alt[i]) {
      ++ties;
      continue;
    }
    if (first < 0) first = static_cast<std::int64_t>(i);
    ++wrong;
    r.max_abs = std::isnan(d) ? INFINITY : std::max(r.max_abs, d);
  }
  double top = 0;
  for (double x : want) top = std::max(top, std::isfinite(x) ? std::abs(x) : 0.0);
  r.max_rel = top > 0 ? r.max_abs / top : (r.max_abs > 0 ? INFINITY : 0);
  r.status = wrong == 0 ? Status::pass : Status::fail;
  const std::string tie_note = ties == 0 ? ""
                                         : "; " + std::to_string(ties) +
                                               " value(s) at a near tie of their rounding took " +
                                               "the other rounding (accepted)";
  if (wrong == 0) {
    r.message = tie_note.empty() ? "" : tie_note.substr(2);
    return r;
  }
  r.ratio = INFINITY;
  const auto i = static_cast<std::size_t>(first);
  const std::string where = locate_exact(op_case_of(golden), g.name, first);
  r.message = std::to_string(wrong) + " of " + std::to_string(want.size()) +
              " values differ from the exact values" +
              (emu ? " (and from them as the precision stores them)" : "") + "; first at " +
              index_str(first, g.shape) + (where.empty() ? "" : " (" + where + ")") +
              ": candidate " + full_digits(cv[i]) + ", exact " + full_digits(want[i]) + tie_note;
  return r;
}

}  // namespace teo::golden::detail
