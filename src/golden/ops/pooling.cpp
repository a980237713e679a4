// The pooling op (docs/golden-format.md, "Op cases"): mean, cls or max pooling over each sequence's
// real tokens.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/pooling.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch sequences of seq_len rows of d_model, each's real tokens (lengths), and the
// config's pooling.
struct PoolingSpec {
  index_t batch = 0, seq = 0, d_model = 0;
  Lengths lengths;
  ModelConfig cfg;
};

const PoolingSpec& own(const Spec& s) {
  return s.as<PoolingSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<PoolingSpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.d_model = r.size("d_model", 1);
  s.lengths = r.lengths("lengths", s.batch, s.seq);
}

void fill(Spec& spec) {
  spec.as<PoolingSpec>().lengths.fill();
}

const std::vector<std::int64_t>* given_ints(const Spec& s, const std::string& name) {
  return name == "input.lengths" ? &own(s).lengths.values : nullptr;
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["d_model"] = s.d_model;
  j["lengths"] = s.lengths.values;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.batch, s.seq, s.d_model}, Role::input));
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  t.out.push_back(float_slot("output.pooled", {s.batch, s.d_model}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max<index_t>(s.seq, s.batch);
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const Values& v = c.v;
  const auto x = c.in("input.x"), dy = c.in("grad.output.pooled");
  const auto& len = spec_ints_of(v, c.s);
  std::vector<std::int64_t> argmax(static_cast<std::size_t>(s.batch * s.d_model), -1);
  pooling_forward(r["output.pooled"].data(), argmax.data(), x.data(), len.data(), s.batch, s.seq,
                  s.d_model, s.cfg.head.pooling);
  c.done("output.pooled");
  pooling_backward(r["grad.input.x"].data(), dy.data(), argmax.data(), len.data(), s.batch, s.seq,
                   s.d_model, s.cfg.head.pooling);
}

}  // namespace

const OpDef& pooling_op() {
  static const OpDef def{
      .name = "pooling",
      .config_keys = {"pooling"},
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
      .config_of = config_in<PoolingSpec>,
      .spec_ints = given_ints,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"batch": 3, "seq_len": 4, "d_model": 3, "lengths": [4, 1, 0], "pooling": "mean"})",
           R"({"batch": 3, "seq_len": 4, "d_model": 3, "lengths": [4, 1, 0], "pooling": "cls"})",
           R"({"batch": 3, "seq_len": 4, "d_model": 3, "lengths": [4, 1, 0], "pooling": "max"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
