// The linear op (docs/golden-format.md, "Op cases"): y = x W^T + b.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "golden/ops/op.hpp"
#include "golden/ops/quantize_case.hpp"
#include "golden/ops/weight_format.hpp"
#include "kernels/fp8_product.hpp"
#include "teo/fp8.hpp"
#include "teo/layers/linear.hpp"
#include "teo/rng.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: rows of in_features, out_features, whether it has a bias, the weight's format
// (dense, or quantized: golden/ops/weight_format.hpp), and W8A8: int8 activations quantized per
// token (forward only).
struct LinearSpec {
  index_t rows = 0, in_f = 0, out_f = 0;
  bool bias = true;
  WeightFormat weight;
  bool w8a8 = false;
};

const LinearSpec& own(const Spec& s) {
  return s.as<LinearSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<LinearSpec>();
  s.rows = r.size("rows", 0);
  s.in_f = r.size("in_features", 1);
  s.out_f = r.size("out_features", 1);
  s.bias = r.flag("bias", true);
  s.weight = read_weight_format(r);
  check_weight_shape(s.weight, s.out_f, s.in_f, "the weight (out_features, in_features)");
  s.w8a8 = r.choice("activation_format", {"none", "int8"}, "none") == "int8";
  if (s.w8a8 && s.weight.name() != "int8") {
    throw ConfigError("spec.activation_format int8 (W8A8) goes with weight_format \"int8\", not " +
                      s.weight.name());
  }
  // an int32 accumulator holds in_features products of at most 128 * 128
  if (s.w8a8 && s.in_f > (std::int64_t{1} << 31) / (std::int64_t{128} * 128)) {
    throw ConfigError("spec.in_features: W8A8's int32 accumulator holds at most 131072 products");
  }
  spec.forward_only = s.w8a8;  // serving: W8A8 has no backward
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["rows"] = s.rows;
  j["in_features"] = s.in_f;
  j["out_features"] = s.out_f;
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["bias"] = s.bias;
  write_weight_format(s.weight, j);
  if (s.w8a8) j["activation_format"] = "int8";
}

// A quantized weight is the case's own quantization: its activations are judged in bf16, fp16 or
// tf32, not under an fp8 recipe that would quantize the weight again.
void check_case(const Spec& spec, const OpCase& c) {
  if (!own(spec).weight.dense() && c.precision == Precision::fp8) {
    throw ConfigError(
        "spec.precision fp8: the weight of a weight_format case is quantized "
        "already (give tf32, bf16 or fp16, or no precision)");
  }
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const double inv_sqrt_in = 1.0 / std::sqrt(static_cast<double>(std::max<index_t>(s.in_f, 1)));
  t.in.push_back(float_slot("input.x", {s.rows, s.in_f}, Role::input));
  if (s.weight.dense()) {
    t.in.push_back(float_slot("param.weight", {s.out_f, s.in_f}, Role::param, inv_sqrt_in));
  } else {
    // a quantized weight has no gradient (weight-only quantization is for serving)
    for (auto& p : weight_slots(s.weight, "param.weight", s.out_f, s.in_f, Role::param))
      t.fixed.push_back(std::move(p));
    Slot d = float_slot("output.weight_dequant", {s.out_f, s.in_f}, Role::output);
    d.optional = d.exact = true;
    t.out.push_back(std::move(d));
  }
  if (s.bias) t.in.push_back(float_slot("param.bias", {s.out_f}, Role::param, inv_sqrt_in));
  if (s.w8a8) {
    // each token's scale and codes, then the exact int32 accumulation of the codes' products
    for (auto [name, d, dims] : {std::tuple{"output.x_scale", DType::F32, Dims{s.rows}},
                                 std::tuple{"output.x_quant", DType::I8, Dims{s.rows, s.in_f}}}) {
      Slot q{name, d, dims, Role::output};
      q.packed = q.exact = q.no_grad = true;
      t.out.push_back(std::move(q));
    }
    t.out.push_back(int_output("output.acc", {s.rows, s.out_f}));
    t.out.back().exact = true;  // under a precision, the emulated run's codes' sums are right too
  }
  t.out.push_back(float_slot("output.y", {s.rows, s.out_f}, Role::output));
  if (spec.fp8_delayed) {  // the dequantization scales of x, W and dY (docs/fp8.md)
    for (const char* n : {"input.fp8_scale.x", "input.fp8_scale.weight", "input.fp8_scale.grad_y"})
      t.fixed.push_back(float_slot(n, {1}, Role::input));
  }
}

// Delayed scales come from an amax history: here each is the tensor's current amax / fp8_max
// times 2^u, u uniform in [1/64, 1) (drawn from the scale's own stream), as stored: up to twice
// the current scale, and above it even after the bf16 rounding (2^(1/64) > 1 + 2^-9, half a bf16
// step), so that nothing saturates and each value keeps up to one bit less.
void draw(const Spec& spec, const OpCase& c, Values& v) {
  const auto& s = own(spec);
  if (!s.weight.dense()) {
    const double amp = 1.0 / std::sqrt(static_cast<double>(s.in_f));
    draw_weight(s.weight, "param.weight", s.out_f, s.in_f, amp, c.seed, v);
  }
  if (!spec.fp8_delayed) return;
  const auto set = [&](const char* scale, const char* of, Fp8Format f) {
    double amax = 0;
    for (double x : v.f.at(of)) amax = std::max(amax, std::fabs(x));
    const double u = (1 + 63 * rng::uniform01(c.seed, rng::stream_id(scale), 0)) / 64;
    std::vector<double> d{amax > 0 ? amax / fp8_max(f) * std::exp2(u) : 1.0};
    as_stored(d, c);
    v.f.at(scale) = d;
  };
  set("input.fp8_scale.x", "input.x", c.fp8.forward);
  set("input.fp8_scale.weight", "param.weight", c.fp8.forward);
  set("input.fp8_scale.grad_y", "grad.output.y", c.fp8.backward);
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.in_f, s.out_f, s.rows});
}

// The three products' operands, as linear_forward and linear_backward name them: y = x W^T,
// grad_x = dY W (op(W) = W^T), grad_weight = dY^T x (op(dY) = dY^T, op(x) = x^T).
std::vector<Fp8OperandSlot> fp8_operands(const Spec& spec) {
  const auto& s = own(spec);
  return {{"y.x", s.rows, s.in_f, false, false},
          {"y.weight", s.out_f, s.in_f, false, true},
          {"grad_x.grad_y", s.rows, s.out_f, true, false},
          {"grad_x.weight", s.in_f, s.out_f, false, true},
          {"grad_weight.grad_y", s.out_f, s.rows, true, false},
          {"grad_weight.x", s.in_f, s.rows, false, false}};
}

std::string locate(const Spec& spec, const std::string& name, std::int64_t i) {
  const auto& s = own(spec);
  return name == "output.weight_dequant" ? locate_weight(s.weight, s.out_f, s.in_f, i) : "";
}

// The weight: the case's own, or a quantized one's exact values (output.weight_dequant) as Real
// holds them, rounded as the precision stores them.
template <class Real>
Tensor<Real> weight_of(RunContext<Real>& c) {
  const auto& s = own(c.s);
  if (s.weight.dense()) return c.in("param.weight");
  const auto exact = dequantize_weight(s.weight, "param.weight", s.out_f, s.in_f, c.v);
  auto& d = c.r.at("output.weight_dequant");
  for (index_t i = 0; i < d.numel(); ++i) d[i] = static_cast<Real>(exact[i]);
  c.done("output.weight_dequant");
  return d;
}

// W8A8 (forward only): each token's int8 scale and codes, acc = the codes' products summed in
// int32 (exact), y = acc * x_scale * weight_scale + b in Real.
template <class Real>
void run_w8a8(RunContext<Real>& c, const Tensor<Real>& x) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const index_t in = s.in_f, out = s.out_f;
  const auto& wq = c.v.raw.at("param.weight");
  const auto ws = packed_numbers(c.v, "param.weight_scale", DType::F32);
  std::vector<std::int8_t> xq(static_cast<std::size_t>(s.rows * in));
  for (index_t i = 0; i < s.rows; ++i) {
    const float sx = int8_scale(x.data() + i * in, in, c.s.float32);
    r.at("output.x_scale")[i] = static_cast<Real>(sx);
    for (index_t k = 0; k < in; ++k) {
      const double q = int8_code(x[i * in + k], sx, c.s.float32);
      xq[static_cast<std::size_t>(i * in + k)] = static_cast<std::int8_t>(q);
      r.at("output.x_quant")[i * in + k] = static_cast<Real>(q);
    }
  }
  const Tensor<Real> b = s.bias ? c.in("param.bias") : Tensor<Real>();
  for (index_t i = 0; i < s.rows; ++i) {
    for (index_t o = 0; o < out; ++o) {
      std::int64_t acc = 0;
      for (index_t k = 0; k < in; ++k) {
        acc += std::int64_t{xq[static_cast<std::size_t>(i * in + k)]} *
               static_cast<std::int8_t>(wq[static_cast<std::size_t>(o * in + k)]);
      }
      // float32 holds integers exactly up to 2^24: a float32 run's larger sum would not be exact
      if (std::is_same_v<Real, float> && (acc > (1 << 24) || acc < -(1 << 24))) {
        throw RangeError("output.acc[" + std::to_string(i * out + o) + "] is " +
                         std::to_string(acc) + ", beyond the integers a float32 run holds " +
                         "exactly (2^24): give the case as float64");
      }
      r.at("output.acc")[i * out + o] = static_cast<Real>(acc);
      Real y = static_cast<Real>(acc) * r.at("output.x_scale")[i] * static_cast<Real>(ws[o]);
      if (s.bias) y += b[o];
      r.at("output.y")[i * out + o] = y;
    }
  }
  c.done("output.y");
}

// W8A8's codes at a near tie of x / x_scale (OpDef::alternates).
std::vector<double> alternates(const Spec& spec, const Values& v, const std::string& name) {
  const auto& s = own(spec);
  if (!s.w8a8 || name != "output.x_quant") return {};
  const auto& x = v.f.at("input.x");
  std::vector<double> out(x.size(), NAN);
  for (index_t i = 0; i < s.rows; ++i) {
    const float sx = int8_scale(x.data() + i * s.in_f, s.in_f, spec.float32);
    if (!(sx > 0)) continue;
    for (index_t k = 0; k < s.in_f; ++k) {
      const auto at = static_cast<std::size_t>(i * s.in_f + k);
      out[at] = other_int8_rounding(x[at] / sx, int8_code(x[at], sx, spec.float32));
    }
  }
  return out;
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  if (s.w8a8) {
    weight_of(c);
    return run_w8a8(c, c.in("input.x"));
  }
  const auto x = c.in("input.x"), w = weight_of(c), dy = c.in("grad.output.y");
  const Tensor<Real> b = s.bias ? c.in("param.bias") : Tensor<Real>();
  std::optional<teo::detail::Fp8DelayedScope> delayed;
  if constexpr (std::is_same_v<Real, float>) {
    if (c.s.fp8_delayed) {
      delayed.emplace(teo::detail::Fp8DelayedScales{.input = c.in("input.fp8_scale.x")[0],
                                                    .weight = c.in("input.fp8_scale.weight")[0],
                                                    .gradient = c.in("input.fp8_scale.grad_y")[0]});
    }
  }
  linear_forward(r["output.y"].data(), x.data(), w.data(), s.bias ? b.data() : nullptr, s.rows,
                 s.in_f, s.out_f);
  c.done("output.y");
  // a quantized weight's gradient is not a result: computed aside and dropped
  Tensor<Real> dw_aside = s.weight.dense() ? Tensor<Real>() : Tensor<Real>(w.shape());
  linear_backward(r["grad.input.x"].data(),
                  s.weight.dense() ? r["grad.param.weight"].data() : dw_aside.data(),
                  s.bias ? r["grad.param.bias"].data() : nullptr, dy.data(), x.data(), w.data(),
                  s.rows, s.in_f, s.out_f);
}

}  // namespace

const OpDef& linear_op() {
  static const OpDef def{
      .name = "linear",
      .config_keys = {},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .check_case = check_case,
      .locate = locate,
      .alternates = alternates,
      .longest_reduction = longest_reduction,
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .fp8_operands = fp8_operands,
      .samples = {R"({"rows": 5, "in_features": 4, "out_features": 3})",
                  R"({"rows": 3, "in_features": 2, "out_features": 4, "bias": false})",
                  R"({"rows": 3, "in_features": 32, "out_features": 8, "weight_format": "gptq",
                      "group_size": 16, "act_order": true})",
                  R"({"rows": 2, "in_features": 16, "out_features": 8, "weight_format": "awq",
                      "group_size": 8})",
                  R"({"rows": 3, "in_features": 32, "out_features": 2, "weight_format": "mxfp4",
                      "bias": false})",
                  R"({"rows": 2, "in_features": 32, "out_features": 3, "weight_format": "nvfp4"})",
                  R"({"rows": 2, "in_features": 256, "out_features": 2,
                      "weight_format": "gguf:Q4_K"})",
                  R"({"rows": 3, "in_features": 8, "out_features": 4, "weight_format": "int8",
                      "activation_format": "int8"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
