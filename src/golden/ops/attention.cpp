// The attention op (docs/golden-format.md, "Op cases"): scaled dot-product attention over heads
// with every variant, materialised or row-blocked.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "golden/ops/op.hpp"
#include "golden/ops/rotary.hpp"
#include "model/model_internal.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/rope.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch sequences of num_heads query heads (num_kv_heads key and value heads) of
// d_head (values d_head_v). Queries and keys of one length (seq_len, kv_seq the same) with each
// sequence's lengths, or of their own (split: q_len and kv_len, q_lengths in `lengths` and
// kv_lengths), the causal diagonal's alignment, the scale, which optional outputs the case has,
// and the attention variants of the config.
struct AttentionSpec {
  index_t batch = 0, heads = 0, seq = 0, kv_seq = 0, d_head = 0, d_head_v = 0, kv_heads = 0;
  bool split = false;
  Lengths lengths, kv_lengths;
  bool top_left = false, probs = true, lse = false;
  bool lse_grad = false;  // the lse takes an upstream gradient (a split-KV backward's)
  std::optional<double> scale;
  ModelConfig cfg;
};

const AttentionSpec& own(const Spec& s) {
  return s.as<AttentionSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<AttentionSpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.heads = r.size("num_heads", 1);
  // seq_len (queries and keys of one length, lengths for both), or q_len and kv_len (q_lengths
  // and kv_lengths, their own tensors)
  const bool split = r.has("q_len") || r.has("kv_len");
  if (split) {
    if (r.has("seq_len")) {
      throw ConfigError(
          "the spec gives seq_len and q_len/kv_len: seq_len sets both, give one or "
          "the other");
    }
    if (r.has("lengths")) {
      throw ConfigError(
          "spec.lengths goes with seq_len: with q_len and kv_len, give q_lengths "
          "and kv_lengths");
    }
    s.seq = r.size("q_len", 1);
    s.kv_seq = r.size("kv_len", 1);
  } else {
    for (const char* k : {"q_lengths", "kv_lengths"}) {
      if (r.has(k)) {
        throw ConfigError(std::string("spec.") + k +
                          " goes with q_len and kv_len; with seq_len, give lengths");
      }
    }
    s.seq = r.size("seq_len", 1);
    s.kv_seq = s.seq;
  }
  s.d_head = r.size("d_head", 1);
  s.d_head_v = r.has("d_head_v") ? r.size("d_head_v", 1) : s.d_head;
  s.kv_heads = r.has("num_kv_heads") ? r.size("num_kv_heads", 1) : s.heads;
  if (s.heads % s.kv_heads != 0) {
    throw ConfigError("spec.num_kv_heads must divide num_heads = " + std::to_string(s.heads) +
                      ", got " + std::to_string(s.kv_heads));
  }
  s.scale = r.number("scale");
  s.top_left = r.choice("causal_align", {"bottom_right", "top_left"}, "bottom_right") == "top_left";
  attention_positions(s.cfg, s.d_head, std::max(s.seq, s.kv_seq), "attention");
  if (split && s.cfg.embeddings.positional == Positional::rope &&
      s.cfg.attention.rope_scaling.type == RopeScalingType::ntk) {
    throw ConfigError(
        "spec.rope_scaling \"ntk\" (dynamic) needs seq_len: its base follows the "
        "sequence's end, which q_len and kv_len leave to the backend");
  }
  {
    const std::int64_t ss =
        checked_mul(checked_mul(checked_mul(s.batch, s.heads, "attention scores"), s.seq, "scores"),
                    s.kv_seq, "attention scores");
    s.probs = r.flag("probs", ss <= kProbsDefaultLimit);
  }
  s.lse_grad = r.flag("lse_grad", false);
  s.lse = r.flag("lse", split || s.lse_grad);
  if (s.lse_grad && !s.lse) throw ConfigError("spec.lse_grad needs lse: true");
  s.split = split;
  if (split) {
    s.lengths = r.lengths("q_lengths", s.batch, s.seq);
    s.kv_lengths = r.lengths("kv_lengths", s.batch, s.kv_seq);
  } else {
    s.lengths = r.lengths("lengths", s.batch, s.seq);
  }
}

void fill(Spec& spec) {
  auto& s = spec.as<AttentionSpec>();
  s.lengths.fill();
  s.kv_lengths.fill();
}

const std::vector<std::int64_t>* given_ints(const Spec& spec, const std::string& name) {
  const auto& s = own(spec);
  if (name == (s.split ? "input.q_lengths" : "input.lengths")) return &s.lengths.values;
  if (s.split && name == "input.kv_lengths") return &s.kv_lengths.values;
  return nullptr;
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["num_heads"] = s.heads;
  if (s.split) {
    j["q_len"] = s.seq;
    j["kv_len"] = s.kv_seq;
  } else {
    j["seq_len"] = s.seq;
  }
  j["d_head"] = s.d_head;
  if (s.d_head_v != s.d_head) j["d_head_v"] = s.d_head_v;
  if (s.kv_heads != s.heads) j["num_kv_heads"] = s.kv_heads;
  if (s.split) {
    j["q_lengths"] = s.lengths.values;
    j["kv_lengths"] = s.kv_lengths.values;
  } else {
    j["lengths"] = s.lengths.values;
  }
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["scale"] = s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.d_head));
  j["probs"] = s.probs;
  if (s.split) j["causal_align"] = s.top_left ? "top_left" : "bottom_right";
  if (s.lse || s.split) j["lse"] = s.lse;
  if (s.lse_grad) j["lse_grad"] = true;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const Dims q = {s.batch, s.heads, s.seq, s.d_head};
  const Dims k = {s.batch, s.kv_heads, s.kv_seq, s.d_head};
  const Dims v = {s.batch, s.kv_heads, s.kv_seq, s.d_head_v};
  t.in.push_back(float_slot("input.q", q, Role::input));
  t.in.push_back(float_slot("input.k", k, Role::input));
  t.in.push_back(float_slot("input.v", v, Role::input));
  if (s.split) {
    t.fixed.push_back({"input.q_lengths", DType::I64, {s.batch}, Role::input});
    t.fixed.push_back({"input.kv_lengths", DType::I64, {s.batch}, Role::input});
  } else {
    t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  }
  if (s.cfg.attention.attn_sinks) t.in.push_back(float_slot("param.sinks", {s.heads}, Role::param));
  // In pipeline order, so that a wrong score is named before the context it spoils. A fused
  // kernel may keep the rotated q and k to itself.
  if (s.cfg.embeddings.positional == Positional::rope) {
    t.out.push_back(float_slot("output.q_rot", q, Role::output));
    t.out.back().optional = true;
    t.out.push_back(float_slot("output.k_rot", k, Role::output));
    t.out.back().optional = true;
  }
  if (s.probs) {
    for (const char* n : {"output.scores", "output.probs"}) {
      t.out.push_back(float_slot(n, {s.batch, s.heads, s.seq, s.kv_seq}, Role::output));
      t.out.back().optional = true;
    }
  }
  if (s.lse) {
    // optional unless an upstream gradient flows into it
    t.out.push_back(float_slot("output.lse", {s.batch, s.heads, s.seq}, Role::output));
    t.out.back().optional = !s.lse_grad;
  }
  t.out.push_back(
      float_slot("output.context", {s.batch, s.heads, s.seq, s.d_head_v}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.seq, s.kv_seq, s.d_head, s.d_head_v});
}

double working_bytes(const Spec& spec) {
  const auto& s = own(spec);
  const auto d = [](index_t x) { return static_cast<double>(x); };
  // RoPE's table of cos and sin, over every position used, and k and v with their padding
  // zeroed
  const double table =
      (s.cfg.embeddings.positional == Positional::rope ? 8 * d(s.kv_seq + s.seq) * d(s.cfg.rotary())
                                                       : 0) +
      8 * d(s.batch) * d(s.kv_heads) * d(s.kv_seq) * d(s.d_head + s.d_head_v);
  // the materialised gradients of scores and probs
  if (!s.probs) return table;
  return table + 2 * d(s.batch) * d(s.heads) * d(s.seq) * d(s.kv_seq) * 8;
}

// RoPE of the op: key j at position j, query i of sequence b at i + shift_b (shift_b =
// kv_lengths[b] - q_lengths[b] bottom-right, else 0); the table covers every position used.
template <class Real>
Rotary<Real> rotary(const AttentionSpec& s, const std::vector<std::int64_t>& q_len,
                    const std::vector<std::int64_t>& kv_len) {
  std::vector<index_t> shift;
  index_t end = s.kv_seq;
  for (index_t b = 0; b < s.batch; ++b) {
    const auto i = static_cast<std::size_t>(b);
    const index_t sh = s.top_left ? 0 : kv_len[i] - q_len[i];
    if (sh < 0) {
      throw ConfigError("spec: with RoPE and bottom-right alignment, sequence " +
                        std::to_string(b) + " has more queries (" + std::to_string(q_len[i]) +
                        ") than keys (" + std::to_string(kv_len[i]) +
                        "): its first queries would sit before position 0");
    }
    shift.push_back(sh);
    end = std::max(end, sh + s.seq);
  }
  return Rotary<Real>(s.cfg, std::move(shift), end);
}

// Whether some sequence has fewer keys than the case's rows.
bool padded(const AttentionSpec& s, const std::vector<std::int64_t>& kv_len) {
  return std::any_of(kv_len.begin(), kv_len.end(), [&](std::int64_t l) { return l < s.kv_seq; });
}

// Zeroes the rows of x (B, heads, rows, d) past each sequence's length.
template <class Real>
void zero_past(Tensor<Real>& x, const std::vector<std::int64_t>& len, index_t heads, index_t rows,
               index_t d) {
  for (std::size_t b = 0; b < len.size(); ++b)
    for (index_t g = 0; g < heads; ++g) {
      Real* block = x.data() + (static_cast<index_t>(b) * heads + g) * rows * d;
      std::fill(block + len[b] * d, block + rows * d, Real(0));
    }
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const Values& v = c.v;
  const auto p = c.p;
  const auto q = c.in("input.q"), k = c.in("input.k"), vv = c.in("input.v");
  const auto dc = c.in("grad.output.context");
  const bool split = s.split;
  const auto& len = spec_ints_of(v, c.s, split ? "input.q_lengths" : "input.lengths");
  const auto& kv_len = split ? spec_ints_of(v, c.s, "input.kv_lengths") : len;
  const bool rope = s.cfg.embeddings.positional == Positional::rope;
  const Tensor<Real> sinks = s.cfg.attention.attn_sinks ? c.in("param.sinks") : Tensor<Real>();
  // The op's config has one head: its sizes and K/V heads come from the spec.
  AttentionArgs<Real> args = teo::detail::attention_args(
      s.cfg, s.batch, s.seq, len.data(), sinks.data(),
      s.cfg.attention.attn_sinks ? r["grad.param.sinks"].data() : nullptr);
  args.heads = s.heads;
  args.d_head = s.d_head;
  args.scale = s.scale;
  args.variant.kv_heads = s.kv_heads;
  args.d_head_v = s.d_head_v;
  if (split) {
    args.kv_len = s.kv_seq;
    args.kv_lengths = kv_len.data();
    args.causal_align = s.top_left ? CausalAlign::top_left : CausalAlign::bottom_right;
  }
  // With RoPE, attention reads q_rot and k_rot, and its q and k gradients are rotated back.
  Tensor<Real> qr, kr, dqr, dkr;
  std::optional<Rotary<Real>> rot;
  if (rope) {
    rot.emplace(rotary<Real>(s, len, kv_len));
    qr = c.zeros("output.q_rot");
    kr = c.zeros("output.k_rot");
    rot->apply(qr.data(), q.data(), s.heads, s.seq, s.d_head, /*back=*/false);
    rope_forward(kr.data(), k.data(), rot->cos.data(), rot->sin.data(), s.batch * s.kv_heads,
                 s.kv_seq, s.d_head, rot->rd, s.cfg.attention.rope_style);
    r["output.q_rot"] = qr;
    r["output.k_rot"] = kr;
    c.done("output.q_rot");
    c.done("output.k_rot");
    qr = r["output.q_rot"];
    kr = r["output.k_rot"];
    dqr = c.zeros("output.q_rot");
    dkr = c.zeros("output.k_rot");
  }
  const Real* qa = rope ? qr.data() : q.data();
  const Real* ka = rope ? kr.data() : k.data();
  // Keys past a sequence's kv_lengths are never visible: they enter the products only with weight
  // 0, and are zeroed first, so that whatever they hold (an uninitialised cache's NaN) reaches no
  // result.
  Tensor<Real> kz, vz;
  if (padded(s, kv_len)) {
    kz = rope ? kr : k;
    vz = vv;
    zero_past(kz, kv_len, s.kv_heads, s.kv_seq, s.d_head);
    zero_past(vz, kv_len, s.kv_heads, s.kv_seq, s.d_head_v);
    ka = kz.data();
  }
  const Real* va = vz.empty() ? vv.data() : vz.data();
  Real* dq = rope ? dqr.data() : r["grad.input.q"].data();
  Real* dk = rope ? dkr.data() : r["grad.input.k"].data();
  Real* dv = r["grad.input.v"].data();
  const Tensor<Real> dlse = s.lse_grad ? c.in("grad.output.lse") : Tensor<Real>();
  const AttentionBackward<Real> grads{.dq = dq,
                                      .dk = dk,
                                      .dv = dv,
                                      .dcontext = dc.data(),
                                      .q = qa,
                                      .k = ka,
                                      .v = va,
                                      .dlse = s.lse_grad ? dlse.data() : nullptr};
  Real* lse = s.lse ? r["output.lse"].data() : nullptr;
  if (s.probs) {
    attention_forward(args, {.context = r["output.context"].data(),
                             .scores = r["output.scores"].data(),
                             .probs = r["output.probs"].data(),
                             .lse = lse,
                             .q = qa,
                             .k = ka,
                             .v = va});
    if (s.lse) c.done("output.lse");
    c.done("output.context");
    auto dprobs = c.zeros("output.probs"), dscores = c.zeros("output.scores");
    AttentionBackward<Real> g = grads;
    g.dprobs = dprobs.data();
    g.dscores = dscores.data();
    g.probs = r["output.probs"].data();
    attention_backward(args, g);
  } else {
    attention_forward_rows(
        args, {.context = r["output.context"].data(), .lse = lse, .q = qa, .k = ka, .v = va});
    if (s.lse) c.done("output.lse");
    c.done("output.context");
    attention_backward_rows(args, grads);
  }
  if (rope) {
    // in the forward pass this was: q_rot, k_rot = RoPE(q), RoPE(k)
    store(dqr, p, "the gradient of output.q_rot");
    store(dkr, p, "the gradient of output.k_rot");
    rot->apply(r["grad.input.q"].data(), dqr.data(), s.heads, s.seq, s.d_head, /*back=*/true);
    rope_backward(r["grad.input.k"].data(), dkr.data(), rot->cos.data(), rot->sin.data(),
                  s.batch * s.kv_heads, s.kv_seq, s.d_head, rot->rd, s.cfg.attention.rope_style);
  }
}

}  // namespace

const std::vector<const char*>& attention_config_keys() {
  static const std::vector<const char*> keys = {
      "causal",         "positional",         "rope_style",     "rotary_dim",
      "rope_base",      "rope_scaling",       "alibi_max_bias", "position_offset",
      "sliding_window", "attn_logit_softcap", "attn_sinks"};
  return keys;
}

json attention_base_config(bool causal) {
  // one head of a width that admits any rotary_dim the spec's d_head can (checked against d_head)
  return json{{"num_layers", 0},  {"vocab_size", 1},      {"num_classes", 1},
              {"d_ff", 1},        {"max_len", 1},         {"num_heads", 1},
              {"d_model", 32768}, {"positional", "none"}, {"causal", causal}};
}

const OpDef& attention_op() {
  static const OpDef def{
      .name = "attention",
      .config_keys = attention_config_keys(),
      .base_config = attention_base_config(/*causal=*/false),
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .config_of = config_in<AttentionSpec>,
      .spec_ints = given_ints,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .run_float = run<float>,
      .run_double = run<double>,
      .has_attention = true,
      .samples =
          {R"({"batch": 2, "num_heads": 2, "seq_len": 4, "d_head": 3, "lengths": [4, 2], "causal": true, "scale": 0.7, "probs": true})",
           R"({"batch": 2, "num_heads": 2, "seq_len": 4, "d_head": 3, "lengths": [4, 2], "causal": true, "scale": 0.7, "probs": false})",
           R"({"batch": 2, "num_heads": 4, "num_kv_heads": 2, "seq_len": 5, "d_head": 4, "lengths": [5, 3], "positional": "rope", "attn_sinks": true, "sliding_window": 3, "attn_logit_softcap": 2.0})",
           R"({"batch": 2, "num_heads": 2, "q_len": 3, "kv_len": 6, "d_head": 4, "d_head_v": 3, "q_lengths": [3, 2], "kv_lengths": [6, 4], "causal": true, "probs": true})",
           R"({"batch": 3, "num_heads": 4, "num_kv_heads": 2, "q_len": 4, "kv_len": 5, "d_head": 4, "d_head_v": 5, "q_lengths": [4, 1, 0], "kv_lengths": [5, 3, 2], "causal": true, "positional": "rope", "attn_sinks": true, "sliding_window": 2, "probs": false})",
           R"({"batch": 2, "num_heads": 2, "q_len": 5, "kv_len": 3, "d_head": 2, "q_lengths": [5, 2], "kv_lengths": [3, 3], "causal": true, "causal_align": "top_left", "positional": "alibi", "attn_logit_softcap": 3.0})",
           R"({"batch": 2, "num_heads": 4, "num_kv_heads": 2, "q_len": 3, "kv_len": 5, "d_head": 3, "d_head_v": 2, "kv_lengths": [5, 0], "lse_grad": true, "attn_sinks": true, "attn_logit_softcap": 2.0, "probs": true})",
           R"({"batch": 2, "num_heads": 2, "q_len": 3, "kv_len": 5, "d_head": 3, "kv_lengths": [4, 0], "causal": true, "lse_grad": true, "probs": false})"},
  };
  return def;
}

}  // namespace teo::golden::ops
