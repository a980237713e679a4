// The patch_embedding op (docs/golden-format.md, "Op cases"): ViT's strided convolution as a
// linear map of each flattened patch, with the [CLS] token prepended (semantics 18.5).
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/patch_embedding.hpp"

namespace teo::golden::ops {

namespace {

PatchDims dims(const Spec& s) {
  return {s.batch, s.channels, s.image_size, s.patch_size, s.cols};
}

void parse(Spec& s, Reader& r) {
  s.batch = r.size("batch", 0);
  s.channels = r.size("channels", 1);
  s.image_size = r.size("image_size", 1);
  s.patch_size = r.size("patch_size", 1);
  s.cols = r.size("d_model", 1);
  if (s.image_size % s.patch_size != 0) {
    throw ConfigError("spec.image_size " + std::to_string(s.image_size) +
                      " must be a multiple of patch_size " + std::to_string(s.patch_size));
  }
}

void write_sizes(const Spec& s, ojson& j) {
  j["batch"] = s.batch;
  j["channels"] = s.channels;
  j["image_size"] = s.image_size;
  j["patch_size"] = s.patch_size;
  j["d_model"] = s.cols;
}

void write_options(const Spec&, ojson&) {}

void tensors(const Spec& s, OpTensors& t) {
  const PatchDims d = dims(s);
  const double bound = 1.0 / std::sqrt(static_cast<double>(d.patch_len()));
  t.in.push_back(
      float_slot("input.pixels", {s.batch, s.channels, s.image_size, s.image_size}, Role::input));
  t.in.push_back(float_slot("param.weight", {s.cols, s.channels, s.patch_size, s.patch_size},
                            Role::param, bound));
  t.in.push_back(float_slot("param.bias", {s.cols}, Role::param, bound));
  t.in.push_back(float_slot("param.cls_token", {s.cols}, Role::param));
  t.out.push_back(float_slot("output.x", {s.batch, 1 + d.patches(), s.cols}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  const PatchDims d = dims(s);
  return std::max({d.patch_len(), s.batch * d.patches(), s.batch, s.cols});
}

// The patches (B Np, K) twice (forward and backward), the projections and their gradient
// (B Np, D), and the pixels' gradient as patches.
double working_bytes(const Spec& s) {
  const PatchDims d = dims(s);
  const auto rows = static_cast<double>(s.batch * d.patches());
  return 8 * rows * (3 * static_cast<double>(d.patch_len()) + 2 * static_cast<double>(s.cols));
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const PatchDims d = dims(s);
  const auto x = c.in("input.pixels"), w = c.in("param.weight"), b = c.in("param.bias");
  const auto cls = c.in("param.cls_token"), dy = c.in("grad.output.x");
  patch_embedding_forward(r["output.x"].data(), x.data(), w.data(), b.data(), cls.data(), d);
  c.done("output.x");
  patch_embedding_backward(r["grad.input.pixels"].data(), r["grad.param.weight"].data(),
                           r["grad.param.bias"].data(), r["grad.param.cls_token"].data(), dy.data(),
                           x.data(), w.data(), d);
}

}  // namespace

const OpDef& patch_embedding_op() {
  static const OpDef def{
      .name = "patch_embedding",
      .config_keys = {},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"batch": 2, "channels": 3, "image_size": 4, "patch_size": 2, "d_model": 5})",
                  R"({"batch": 1, "channels": 1, "image_size": 3, "patch_size": 3, "d_model": 2})"},
  };
  return def;
}

}  // namespace teo::golden::ops
