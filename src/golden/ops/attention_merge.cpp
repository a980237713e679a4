// The attention_merge op (docs/golden-format.md, "Op cases"): the combine of split-KV attention.
// Part p attended to its own share of the keys and gave each row a context c_p and log-sum-exp
// lse_p; the merged row has lse = log sum_p exp(lse_p) and context sum_p exp(lse_p - lse) c_p.
// An empty part (lse_p = -inf) contributes nothing. Forward and backward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "golden/ops/op.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: num_parts parts of (batch, num_heads, q_len) rows of d_head_v, and the parts that
// are empty (sorted).
struct AttentionMergeSpec {
  index_t parts = 0, batch = 0, heads = 0, seq = 0, d_head_v = 0;
  std::vector<std::int64_t> empty_parts;
};

const AttentionMergeSpec& own(const Spec& s) {
  return s.as<AttentionMergeSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<AttentionMergeSpec>();
  s.parts = r.size("num_parts", 1);
  s.batch = r.size("batch", 0);
  s.heads = r.size("num_heads", 1);
  s.seq = r.size("q_len", 0);
  s.d_head_v = r.size("d_head_v", 1);
  if (r.has("empty_parts")) {
    const json& e = r.value("empty_parts");
    if (!e.is_array()) throw ConfigError("spec.empty_parts must be an array of part indices");
    for (const auto& x : e) {
      if (!x.is_number_integer() || x.get<std::int64_t>() < 0 || x.get<std::int64_t>() >= s.parts) {
        throw ConfigError("spec.empty_parts must hold part indices in [0, num_parts = " +
                          std::to_string(s.parts) + "), got " + x.dump());
      }
      s.empty_parts.push_back(x.get<std::int64_t>());
    }
    std::sort(s.empty_parts.begin(), s.empty_parts.end());
    if (std::adjacent_find(s.empty_parts.begin(), s.empty_parts.end()) != s.empty_parts.end())
      throw ConfigError("spec.empty_parts names a part twice");
  }
  r.use("empty_parts");
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["num_parts"] = s.parts;
  j["batch"] = s.batch;
  j["num_heads"] = s.heads;
  j["q_len"] = s.seq;
  j["d_head_v"] = s.d_head_v;
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["empty_parts"] = s.empty_parts;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const Dims rows = {s.batch, s.heads, s.seq};
  t.in.push_back(float_slot("input.context_parts", {s.parts, s.batch, s.heads, s.seq, s.d_head_v},
                            Role::input));
  // a part's log-sum-exp: the log of a softmax denominator, around log(keys) + a typical score
  t.in.push_back(float_slot("input.lse_parts", {s.parts, s.batch, s.heads, s.seq}, Role::input,
                            /*amp=*/3, /*offset=*/2));
  t.out.push_back(float_slot("output.lse", rows, Role::output));
  t.out.push_back(
      float_slot("output.context", {s.batch, s.heads, s.seq, s.d_head_v}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max(s.parts, s.d_head_v);
}

void draw(const Spec& spec, const OpCase&, Values& v) {
  const auto& s = own(spec);
  // an empty part: lse -inf and a context of 0, as a kernel gives for a split with no keys
  const index_t rows = s.batch * s.heads * s.seq;
  auto& c = v.f.at("input.context_parts");
  auto& l = v.f.at("input.lse_parts");
  for (auto p : s.empty_parts) {
    std::fill_n(l.begin() + p * rows, rows, -INFINITY);
    std::fill_n(c.begin() + p * rows * s.d_head_v, rows * s.d_head_v, 0.0);
  }
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const auto cp = c.in("input.context_parts"), lp = c.in("input.lse_parts");
  const auto dctx = c.in("grad.output.context"), dlse = c.in("grad.output.lse");
  const index_t rows = s.batch * s.heads * s.seq, dv = s.d_head_v, P = s.parts;
  const Real neg_inf = -std::numeric_limits<Real>::infinity();
  Real* lse = r.at("output.lse").data();
  Real* ctx = r.at("output.context").data();
  // Forward, row by row, parts in order; a part with lse -inf is skipped.
  for (index_t n = 0; n < rows; ++n) {
    Real m = neg_inf;
    for (index_t p = 0; p < P; ++p)
      if (lp[p * rows + n] != neg_inf) m = std::max(m, lp[p * rows + n]);
    if (m == neg_inf) {
      lse[n] = neg_inf;  // nothing to merge: context stays 0
      continue;
    }
    Real sum = 0;
    for (index_t p = 0; p < P; ++p)
      if (lp[p * rows + n] != neg_inf) sum += std::exp(lp[p * rows + n] - m);
    lse[n] = m + std::log(sum);
  }
  c.done("output.lse");
  for (index_t n = 0; n < rows; ++n) {
    if (lse[n] == neg_inf) continue;
    Real* out = ctx + n * dv;
    for (index_t p = 0; p < P; ++p) {
      if (lp[p * rows + n] == neg_inf) continue;
      const Real w = std::exp(lp[p * rows + n] - lse[n]);
      const Real* part = cp.data() + (p * rows + n) * dv;
      for (index_t d = 0; d < dv; ++d) out[d] += w * part[d];
    }
  }
  c.done("output.context");
  // Backward: with w_p = exp(lse_p - lse), dc_p = w_p dctx and
  // dlse_p = w_p (dctx . (c_p - ctx) + dlse); an empty part gets 0.
  Real* dcp = r.at("grad.input.context_parts").data();
  Real* dlp = r.at("grad.input.lse_parts").data();
  for (index_t n = 0; n < rows; ++n) {
    if (lse[n] == neg_inf) continue;
    const Real* g = dctx.data() + n * dv;
    for (index_t p = 0; p < P; ++p) {
      if (lp[p * rows + n] == neg_inf) continue;
      const Real w = std::exp(lp[p * rows + n] - lse[n]);
      const Real* part = cp.data() + (p * rows + n) * dv;
      Real dot = 0;
      for (index_t d = 0; d < dv; ++d) {
        dcp[(p * rows + n) * dv + d] = w * g[d];
        dot += g[d] * (part[d] - ctx[n * dv + d]);
      }
      dlp[p * rows + n] = w * (dot + dlse[n]);
    }
  }
}

}  // namespace

const OpDef& attention_merge_op() {
  static const OpDef def{
      .name = "attention_merge",
      .config_keys = {},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"num_parts": 3, "batch": 2, "num_heads": 2, "q_len": 3, "d_head_v": 4})",
           R"({"num_parts": 2, "batch": 1, "num_heads": 1, "q_len": 2, "d_head_v": 3, "empty_parts": [1]})",
           R"({"num_parts": 2, "batch": 1, "num_heads": 2, "q_len": 1, "d_head_v": 2, "empty_parts": [0, 1]})"},
  };
  return def;
}

}  // namespace teo::golden::ops
