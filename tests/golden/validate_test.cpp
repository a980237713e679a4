// golden::validate: a malformed golden, model or op case, is a FormatError naming the tensor at
// fault, raised before any value is read: by validate itself, by check (plain and budget), by
// emulate and by run_op. A wrong sinks gradient fails at its tensor.
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;

const fs::path kCorpus = fs::path(TEO_SOURCE_DIR) / "golden";

st::File corpus(const std::string& name) {
  return st::read((kCorpus / (name + ".safetensors")).string());
}

st::Tensor& tensor(st::File& f, const std::string& name) {
  for (auto& t : f.tensors)
    if (t.name == name) return t;
  throw std::runtime_error("no " + name);
}

void erase(st::File& f, const std::string& name) {
  std::erase_if(f.tensors, [&](const st::Tensor& t) { return t.name == name; });
}

// Halves a tensor's first dimension, keeping its first half of the bytes.
void shrink(st::File& f, const std::string& name) {
  auto& t = tensor(f, name);
  t.shape[0] /= 2;
  t.bytes.resize(static_cast<std::size_t>(t.numel()) * st::dtype_size(t.dtype));
}

template <class T>
void set(st::File& f, const std::string& name, std::size_t i, T v) {
  auto& t = tensor(f, name);
  std::memcpy(t.bytes.data() + i * sizeof(T), &v, sizeof(T));
}

// Every entry point that reads a golden refuses `bad` with a FormatError whose message holds
// `names`.
void expect_refused(const st::File& bad, const std::string& names, bool budget = true) {
  const auto expect = [&](const char* what, const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << what << " accepted the malformed golden";
    } catch (const teo::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << what << ": " << e.what();
    }
  };
  expect("validate", [&] { golden::validate(bad); });
  expect("check", [&] { golden::check(bad, bad, {}); });
  if (budget) {
    golden::CheckOptions bf16;
    bf16.precision = teo::Precision::bf16;
    expect("check --precision bf16", [&] { golden::check(bad, bad, bf16); });
    expect("emulate", [&] { golden::emulate(bad, teo::Precision::bf16); });
  }
}

TEST(GoldenValidate, EveryCommittedCaseValidates) {
  for (const char* dir : {"", "ops"}) {
    for (const auto& e : fs::directory_iterator(kCorpus / dir)) {
      if (e.path().extension() != ".safetensors") continue;
      EXPECT_NO_THROW(golden::validate(st::read(e.path().string()))) << e.path();
    }
  }
}

TEST(GoldenValidate, AMissingTensorIsNamed) {
  st::File f = corpus("sinks_masked_f64");
  erase(f, "grad.layers.0.attn.sinks");
  expect_refused(f, "has no grad.layers.0.attn.sinks [H]");
  st::File g = corpus("dropout_post_f32");
  erase(g, "ref64.act.logits");
  expect_refused(g, "has no ref64.act.logits");
  st::File m = corpus("dropout_post_f32");
  erase(m, "dropout.layers.1.ffn");
  expect_refused(m, "has no dropout.layers.1.ffn [B, S, F]");
}

TEST(GoldenValidate, ATensorTheContractDoesNotNameIsRefused) {
  st::File f = corpus("post_gelu_mean_f64");
  st::Tensor extra = tensor(f, "act.layers.0.output");
  extra.name = "act.layer.0.output";
  f.tensors.push_back(extra);
  expect_refused(f, "holds act.layer.0.output, which is not in the contract");
}

// The over-reads the issue names: a probs tensor smaller than its config says (the budget check
// read the emulated run's values up to the golden's size), and lengths or tokens out of range
// (the conditioning read lengths[b] for the tokens' B and S).
TEST(GoldenValidate, AShapeThatIsNotTheContractsIsNamedBeforeAnyValueIsRead) {
  st::File f = corpus("post_gelu_mean_f32");
  shrink(f, "act.layers.0.probs");
  expect_refused(f,
                 "act.layers.0.probs has shape [1, 3, 9, 9], its contract's is [B, H, S, S] = "
                 "[3, 3, 9, 9]");
  st::File g = corpus("post_gelu_mean_f64");
  shrink(g, "input.tokens");
  expect_refused(g, "input.tokens");
  st::File h = corpus("post_gelu_mean_f64");
  tensor(h, "param.head.bias").dtype = st::DType::I64;
  expect_refused(h, "param.head.bias is I64, its contract's dtype is F64");
}

TEST(GoldenValidate, InputsOutsideTheirRangeAreNamed) {
  st::File f = corpus("post_gelu_mean_f64");
  const auto cfg = golden::case_of(f).config;
  set<std::int64_t>(f, "input.tokens", 3, cfg.embeddings.vocab_size);
  expect_refused(f, "input.tokens holds " + std::to_string(cfg.embeddings.vocab_size) + " at [3]");
  st::File g = corpus("post_gelu_mean_f64");
  set<std::int64_t>(g, "input.labels", 1, -1);
  expect_refused(g, "input.labels holds -1");
  st::File h = corpus("post_gelu_mean_f64");
  set<std::int64_t>(h, "input.lengths", 0, 1000);
  expect_refused(h, "input.lengths holds 1000");
  st::File k = corpus("post_gelu_mean_f64");
  set<std::int64_t>(k, "input.lengths", 0, 1);
  expect_refused(k, "input.lengths are not its case's lengths");
}

// A tiny file whose config claims 10^7 layers (of an empty batch, so that no memory limit refuses
// it) is refused before its contract is listed.
TEST(GoldenValidate, AConfigOfMoreLayersThanTheFileHoldsIsRefusedCheaply) {
  st::File f = corpus("post_gelu_mean_f64");
  for (auto& [k, v] : f.metadata) {
    if (k != "config") continue;
    auto j = nlohmann::json::parse(v);
    j["num_layers"] = 10000000;
    j["d_model"] = 2;
    j["num_heads"] = 1;
    j["d_ff"] = 1;
    v = j.dump();
  }
  for (auto& [k, v] : f.metadata) {
    if (k != "case") continue;
    auto j = nlohmann::json::parse(v);  // an empty batch: no activation memory to refuse it
    j["batch"] = 0;
    j["lengths"] = nlohmann::json::array();
    v = j.dump();
  }
  expect_refused(f, "layers, but the file holds only");
}

TEST(GoldenValidate, AFileWrittenWithKeepMayLeaveOutComputedTensorsOnly) {
  st::File f = corpus("dropout_post_f32");
  golden::keep_only(f, "act.logits,grad.head.*");
  EXPECT_NO_THROW(golden::validate(f));
  erase(f, "param.head.bias");
  EXPECT_THROW(golden::validate(f), teo::FormatError);
  st::File g = corpus("dropout_post_f32");
  golden::keep_only(g, "act.logits");
  erase(g, "ref64.act.logits");
  EXPECT_THROW(golden::validate(g), teo::FormatError);
}

TEST(GoldenValidate, AMalformedOpCaseIsNamed) {
  st::File f = st::read((kCorpus / "ops" / "attention_causal_f64.safetensors").string());
  shrink(f, "grad.output.context");
  expect_refused(f, "grad.output.context");
  EXPECT_THROW(golden::run_op(f), teo::FormatError);
  st::File g = st::read((kCorpus / "ops" / "attention_causal_f64.safetensors").string());
  set<std::int64_t>(g, "input.lengths", 0, 0);
  expect_refused(g, "input.lengths are not its spec's lengths");
  EXPECT_THROW(golden::run_op(g), teo::FormatError);
  st::File h = st::read((kCorpus / "ops" / "attention_causal_f64.safetensors").string());
  erase(h, "output.context");
  expect_refused(h, "has no output.context");
}

// A backend whose sinks gradient is wrong fails at that tensor: the corpus holds it now.
TEST(GoldenValidate, AWrongSinksGradientFailsAtItsTensor) {
  for (const char* name : {"sinks_masked_f64", "sinks_masked_f32", "everything_variants_f64"}) {
    const st::File g = corpus(name);
    st::File c = g;
    auto& t = tensor(c, "grad.layers.0.attn.sinks");
    auto v = t.float_values();
    v[1] *= 1.01;
    if (t.dtype == st::DType::F64) {
      std::memcpy(t.bytes.data(), v.data(), v.size() * sizeof(double));
    } else {
      const auto f = static_cast<float>(v[1]);
      std::memcpy(t.bytes.data() + sizeof(float), &f, sizeof(float));
    }
    const auto r = golden::check(g, c, {});
    EXPECT_EQ(r.failed, 1) << name;
    EXPECT_EQ(r.first_divergence, "grad.layers.0.attn.sinks") << name;
    EXPECT_EQ(golden::check(g, g, {}).failed, 0) << name;
  }
}

}  // namespace
