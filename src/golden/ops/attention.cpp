// The attention op (docs/golden-format.md, "Op cases"): scaled dot-product attention over heads
// with every variant, materialised or row-blocked.
#include <cmath>

#include "golden/ops/op.hpp"
#include "model/model_internal.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/rope.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.batch = r.size("batch", 0);
  s.heads = r.size("num_heads", 1);
  s.seq = r.size("seq_len", 1);
  s.d_head = r.size("d_head", 1);
  s.kv_heads = r.has("num_kv_heads") ? r.size("num_kv_heads", 1) : s.heads;
  if (s.heads % s.kv_heads != 0) {
    throw ConfigError("spec.num_kv_heads must divide num_heads = " + std::to_string(s.heads) +
                      ", got " + std::to_string(s.kv_heads));
  }
  s.scale = r.number("scale");
  attention_positions(s, "attention");
  {
    const std::int64_t ss =
        checked_mul(checked_mul(checked_mul(s.batch, s.heads, "attention scores"), s.seq, "scores"),
                    s.seq, "attention scores");
    s.probs = r.flag("probs", ss <= kProbsDefaultLimit);
  }
}

void write_sizes(const Spec& s, ojson& j) {
  j["batch"] = s.batch;
  j["num_heads"] = s.heads;
  j["seq_len"] = s.seq;
  j["d_head"] = s.d_head;
  if (s.kv_heads != s.heads) j["num_kv_heads"] = s.kv_heads;
}

void write_options(const Spec& s, ojson& j) {
  j["scale"] = s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.d_head));
  j["probs"] = s.probs;
}

void tensors(const Spec& s, OpTensors& t) {
  const Dims qkv = {s.batch, s.heads, s.seq, s.d_head};
  const Dims kv = {s.batch, s.kv_heads, s.seq, s.d_head};
  t.in.push_back(float_slot("input.q", qkv, Role::input));
  t.in.push_back(float_slot("input.k", kv, Role::input));
  t.in.push_back(float_slot("input.v", kv, Role::input));
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  if (s.cfg.attn_sinks) t.in.push_back(float_slot("param.sinks", {s.heads}, Role::param));
  // In pipeline order, so that a wrong score is named before the context it spoils. A fused
  // kernel may keep the rotated q and k to itself.
  if (s.cfg.positional == Positional::rope) {
    t.out.push_back(float_slot("output.q_rot", qkv, Role::output));
    t.out.back().optional = true;
    t.out.push_back(float_slot("output.k_rot", kv, Role::output));
    t.out.back().optional = true;
  }
  if (s.probs) {
    for (const char* n : {"output.scores", "output.probs"}) {
      t.out.push_back(float_slot(n, {s.batch, s.heads, s.seq, s.seq}, Role::output));
      t.out.back().optional = true;
    }
  }
  t.out.push_back(float_slot("output.context", qkv, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max(s.seq, s.d_head);
}

double working_bytes(const Spec& s) {
  // the materialised gradients of scores and probs
  if (!s.probs) return 0;
  const auto d = [](index_t x) { return static_cast<double>(x); };
  return 2 * d(s.batch) * d(s.heads) * d(s.seq) * d(s.seq) * 8;
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const Values& v = c.v;
  const auto p = c.p;
  const auto q = c.in("input.q"), k = c.in("input.k"), vv = c.in("input.v");
  const auto dc = c.in("grad.output.context");
  const auto& len = lengths_of(v, s);
  const bool rope = s.cfg.positional == Positional::rope;
  const Tensor<Real> sinks = s.cfg.attn_sinks ? c.in("param.sinks") : Tensor<Real>();
  // The op's config has one head: its sizes and K/V heads come from the spec.
  AttentionArgs<Real> args =
      teo::detail::attention_args(s.cfg, s.batch, s.seq, len.data(), sinks.data(),
                                  s.cfg.attn_sinks ? r["grad.param.sinks"].data() : nullptr);
  args.heads = s.heads;
  args.d_head = s.d_head;
  args.scale = s.scale;
  args.variant.kv_heads = s.kv_heads;
  // With RoPE, attention reads q_rot and k_rot, and its q and k gradients are rotated back.
  Tensor<Real> qr, kr, dqr, dkr, cs, sn;
  const index_t rd = s.cfg.rotary();
  if (rope) {
    cs = Tensor<Real>({s.seq, rd / 2});
    sn = Tensor<Real>({s.seq, rd / 2});
    rope_table(cs.data(), sn.data(), s.cfg, s.seq);
    qr = c.zeros("output.q_rot");
    kr = c.zeros("output.k_rot");
    rope_forward(qr.data(), q.data(), cs.data(), sn.data(), s.batch * s.heads, s.seq, s.d_head, rd,
                 s.cfg.rope_style);
    rope_forward(kr.data(), k.data(), cs.data(), sn.data(), s.batch * s.kv_heads, s.seq, s.d_head,
                 rd, s.cfg.rope_style);
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
  Real* dq = rope ? dqr.data() : r["grad.input.q"].data();
  Real* dk = rope ? dkr.data() : r["grad.input.k"].data();
  Real* dv = r["grad.input.v"].data();
  const AttentionBackward<Real> grads{
      .dq = dq, .dk = dk, .dv = dv, .dcontext = dc.data(), .q = qa, .k = ka, .v = vv.data()};
  if (s.probs) {
    attention_forward(args, {.context = r["output.context"].data(),
                             .scores = r["output.scores"].data(),
                             .probs = r["output.probs"].data(),
                             .q = qa,
                             .k = ka,
                             .v = vv.data()});
    c.done("output.context");
    auto dprobs = c.zeros("output.probs"), dscores = c.zeros("output.scores");
    AttentionBackward<Real> g = grads;
    g.dprobs = dprobs.data();
    g.dscores = dscores.data();
    g.probs = r["output.probs"].data();
    attention_backward(args, g);
  } else {
    attention_forward_rows(
        args, {.context = r["output.context"].data(), .q = qa, .k = ka, .v = vv.data()});
    c.done("output.context");
    attention_backward_rows(args, grads);
  }
  if (rope) {
    // in the forward pass this was: q_rot, k_rot = RoPE(q), RoPE(k)
    store(dqr, p, "the gradient of output.q_rot");
    store(dkr, p, "the gradient of output.k_rot");
    rope_backward(r["grad.input.q"].data(), dqr.data(), cs.data(), sn.data(), s.batch * s.heads,
                  s.seq, s.d_head, rd, s.cfg.rope_style);
    rope_backward(r["grad.input.k"].data(), dkr.data(), cs.data(), sn.data(), s.batch * s.kv_heads,
                  s.seq, s.d_head, rd, s.cfg.rope_style);
  }
}

}  // namespace

const OpDef& attention_op() {
  // The config only carries the options: one head of a width that admits any rotary_dim the
  // spec's d_head can (checked against d_head).
  static const OpDef def{
      .name = "attention",
      .config_keys = {"causal", "positional", "rope_style", "rotary_dim", "rope_base",
                      "rope_scaling", "alibi_max_bias", "position_offset", "sliding_window",
                      "attn_logit_softcap", "attn_sinks"},
      .base_config = json{{"num_layers", 0},
                          {"vocab_size", 1},
                          {"num_classes", 1},
                          {"d_ff", 1},
                          {"max_len", 1},
                          {"num_heads", 1},
                          {"d_model", 32768},
                          {"positional", "none"}},
      .lengths_key = "lengths",
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"batch": 2, "num_heads": 2, "seq_len": 4, "d_head": 3, "lengths": [4, 2], "causal": true, "scale": 0.7, "probs": true})",
           R"({"batch": 2, "num_heads": 2, "seq_len": 4, "d_head": 3, "lengths": [4, 2], "causal": true, "scale": 0.7, "probs": false})",
           R"({"batch": 2, "num_heads": 4, "num_kv_heads": 2, "seq_len": 5, "d_head": 4, "lengths": [5, 3], "positional": "rope", "attn_sinks": true, "sliding_window": 3, "attn_logit_softcap": 2.0})"},
  };
  return def;
}

}  // namespace teo::golden::ops
