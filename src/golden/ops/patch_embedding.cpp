// The patch_embedding op (docs/golden-format.md, "Op cases"): ViT's strided convolution as a
// linear map of each flattened patch, with the [CLS] token prepended (semantics 18.5).
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/patch_embedding.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch images of `channels` channels, image_size x image_size, in patch_size
// patches, projected to d_model.
struct PatchEmbeddingSpec {
  index_t batch = 0, channels = 0, image_size = 0, patch_size = 0, d_model = 0;
};

const PatchEmbeddingSpec& own(const Spec& s) {
  return s.as<PatchEmbeddingSpec>();
}

PatchDims dims(const PatchEmbeddingSpec& s) {
  return {s.batch, s.channels, s.image_size, s.patch_size, s.d_model};
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<PatchEmbeddingSpec>();
  s.batch = r.size("batch", 0);
  s.channels = r.size("channels", 1);
  s.image_size = r.size("image_size", 1);
  s.patch_size = r.size("patch_size", 1);
  s.d_model = r.size("d_model", 1);
  if (s.image_size % s.patch_size != 0) {
    throw ConfigError("spec.image_size " + std::to_string(s.image_size) +
                      " must be a multiple of patch_size " + std::to_string(s.patch_size));
  }
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["channels"] = s.channels;
  j["image_size"] = s.image_size;
  j["patch_size"] = s.patch_size;
  j["d_model"] = s.d_model;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const PatchDims d = dims(s);
  const double bound = 1.0 / std::sqrt(static_cast<double>(d.patch_len()));
  t.in.push_back(
      float_slot("input.pixels", {s.batch, s.channels, s.image_size, s.image_size}, Role::input));
  t.in.push_back(float_slot("param.weight", {s.d_model, s.channels, s.patch_size, s.patch_size},
                            Role::param, bound));
  t.in.push_back(float_slot("param.bias", {s.d_model}, Role::param, bound));
  t.in.push_back(float_slot("param.cls_token", {s.d_model}, Role::param));
  t.out.push_back(float_slot("output.x", {s.batch, 1 + d.patches(), s.d_model}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  const PatchDims d = dims(s);
  return std::max({d.patch_len(), s.batch * d.patches(), s.batch, s.d_model});
}

// The patches (B Np, K) twice (forward and backward), the projections and their gradient
// (B Np, D), and the pixels' gradient as patches.
double working_bytes(const Spec& spec) {
  const auto& s = own(spec);
  const PatchDims d = dims(s);
  const auto rows = static_cast<double>(s.batch * d.patches());
  return 8 * rows * (3 * static_cast<double>(d.patch_len()) + 2 * static_cast<double>(s.d_model));
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
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
