// The contract (teo/contract.hpp): its lists agree with what the model computes, every parameter
// has its gradient, every committed golden holds exactly its contract, and the tables of
// docs/golden-format.md say what the contract says.
#include "teo/contract.hpp"

#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include <gtest/gtest.h>

#include "support.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/model.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
using teo::index_t;
using teo::ModelConfig;
namespace contract = teo::contract;

// Configs that between them turn on every optional tensor: learned positions, pre-norm's final
// norm, RoPE's rotated q and k, grouped-query k and v, sinks and dropout masks.
std::vector<std::pair<std::string, ModelConfig>> configs() {
  std::vector<std::pair<std::string, ModelConfig>> out;
  ModelConfig plain;
  out.emplace_back("post-norm, sinusoidal", plain);
  ModelConfig pre = plain;
  pre.norms.norm_first = true;
  pre.embeddings.positional = teo::Positional::learned;
  pre.dropout = 0.25;
  out.emplace_back("pre-norm, learned, dropout", pre);
  ModelConfig gqa = plain;
  gqa.d_model = 24;
  gqa.attention.num_heads = 6;
  gqa.attention.num_kv_heads = 2;
  gqa.embeddings.positional = teo::Positional::rope;
  gqa.attention.attn_sinks = true;
  gqa.num_layers = 3;
  out.emplace_back("GQA + RoPE + sinks", gqa);
  ModelConfig gqa_pre = gqa;
  gqa_pre.norms.norm_first = true;
  gqa_pre.dropout = 0.1;
  out.emplace_back("GQA + RoPE + sinks, pre-norm, dropout", gqa_pre);
  ModelConfig none = plain;
  none.num_layers = 0;
  out.emplace_back("no layers", none);
  ModelConfig geglu = pre;
  geglu.ffn.kind = teo::FfnKind::geglu;
  out.emplace_back("GeGLU with biases, pre-norm", geglu);
  ModelConfig llama = plain;
  llama.architecture = teo::Architecture::decoder;
  llama.attention.causal = true;
  llama.norms.norm_first = true;
  llama.norms.norm = teo::Norm::rmsnorm;
  llama.ffn.kind = teo::FfnKind::swiglu;
  llama.attention.attn_bias = llama.ffn.ffn_bias = llama.head.head_bias = false;
  out.emplace_back("LLaMA decoder: RMSNorm, SwiGLU, no biases, its own LM head", llama);
  ModelConfig qwen3 = llama;
  qwen3.embeddings.positional = teo::Positional::rope;
  qwen3.attention.qk_norm = true;
  qwen3.attention.head_dim = 12;  // H Dh = 24 against D = 16
  out.emplace_back("Qwen3 decoder: q/k norms, heads of head_dim apart from d_model", qwen3);
  ModelConfig deepseek = llama;
  deepseek.embeddings.positional = teo::Positional::rope;
  deepseek.attention.kv_lora_rank = 5;
  deepseek.attention.q_lora_rank = 7;
  deepseek.attention.qk_nope_head_dim = 3;
  deepseek.attention.qk_rope_head_dim = 4;
  deepseek.attention.v_head_dim = 2;
  out.emplace_back("DeepSeek-V3 decoder: latent attention, q from its own latent", deepseek);
  ModelConfig v2_lite = deepseek;
  v2_lite.attention.q_lora_rank.reset();
  out.emplace_back("DeepSeek-V2-Lite decoder: latent attention, q from x", v2_lite);
  ModelConfig gpt2 = plain;
  gpt2.architecture = teo::Architecture::decoder;
  gpt2.attention.causal = true;
  gpt2.head.tie_embeddings = true;
  out.emplace_back("decoder with a tied LM head and its bias", gpt2);
  ModelConfig seq2seq = plain;
  seq2seq.architecture = teo::Architecture::encoder_decoder;
  seq2seq.norms.norm_first = true;
  seq2seq.embeddings.positional = teo::Positional::learned;
  seq2seq.embeddings.decoder_vocab_size = 9;
  seq2seq.decoder_layers = 3;
  seq2seq.ffn.kind = teo::FfnKind::geglu;
  out.emplace_back("encoder-decoder: pre-norm, learned positions, own target vocabulary, GeGLU",
                   seq2seq);
  ModelConfig bert = plain;
  bert.embeddings.positional = teo::Positional::learned;
  bert.embeddings.type_vocab_size = 2;
  bert.embeddings.embedding_norm = true;
  bert.head.pooler = teo::Pooler::dense_tanh;
  bert.head.pooling = teo::Pooling::cls;
  out.emplace_back("BERT: token types, embedding LayerNorm, pooler", bert);
  ModelConfig vit = plain;  // 4 x 4 images in 2 x 2 patches: S = 1 + 4 = 5
  vit.embeddings.input = teo::InputKind::patches;
  vit.embeddings.image_size = 4;
  vit.embeddings.patch_size = 2;
  vit.embeddings.channels = 3;
  vit.embeddings.max_len = 5;
  vit.norms.norm_first = true;
  vit.embeddings.positional = teo::Positional::learned;
  vit.head.pooling = teo::Pooling::cls;
  out.emplace_back("ViT: patches, [CLS], pre-norm", vit);
  return out;
}

TEST(Contract, EveryParameterHasItsGradientWithItsShapeAndNamesAreUnique) {
  for (const auto& [what, cfg] : configs()) {
    SCOPED_TRACE(what);
    for (bool f32 : {false, true}) {
      const auto all = contract::model_case(cfg, {3, 5}, f32);
      std::map<std::string, contract::TensorSpec> by_name;
      for (const auto& t : all) EXPECT_TRUE(by_name.emplace(t.name, t).second) << t.name;
      int params = 0;
      for (const auto& t : all) {
        if (t.role != contract::Role::param) continue;
        ++params;
        const std::string grad = "grad." + t.name.substr(6);
        ASSERT_TRUE(by_name.contains(grad)) << grad;
        EXPECT_EQ(by_name.at(grad).shape, t.shape) << grad;
        EXPECT_EQ(by_name.at(grad).dims, t.dims) << grad;
        if (f32) {
          EXPECT_TRUE(by_name.contains("ref64." + grad)) << grad;
        }
      }
      EXPECT_EQ(params, static_cast<int>(contract::params(cfg).size()));
      // every act.X with its symbolic shape; every grad.act.X has its act.X
      for (const auto& t : all) {
        if (t.name.starts_with("grad.act.")) {
          EXPECT_TRUE(by_name.contains("act." + t.name.substr(9))) << t.name;
        }
        EXPECT_EQ(t.shape.size(), t.dims.size()) << t.name;
      }
    }
  }
}

TEST(Contract, ShapesAreWhatTheModelComputes) {
  for (const auto& [what, cfg] : configs()) {
    SCOPED_TRACE(what);
    const index_t B = 3, S = 5;
    const auto batch =
        cfg.encoder_decoder()
            ? teo::Batch::random_seq2seq(cfg, B, S, 4, 7, {5, 2, 0}, {4, 0, 1})
            : teo::Batch::random(cfg, B, S, 7,
                                 cfg.patches_input() ? std::vector<std::int64_t>{}
                                                     : std::vector<std::int64_t>{5, 2, 0});
    const contract::Sizes sizes{B, S, 0, batch.tgt_len};
    const auto params = teo::Params<double>::init(cfg, 3);
    teo::Activations<double> acts, dacts;
    teo::forward(params, batch, acts, {.train = true, .dropout_seed = 1});
    teo::Params<double> grads;
    teo::backward(params, batch, acts, grads, dacts);
    std::map<std::string, std::vector<index_t>> model;
    params.visit([&](const std::string& n, const teo::Tensor<double>& t) {
      model["param." + n] = t.shape().dims();
    });
    grads.visit([&](const std::string& n, const teo::Tensor<double>& t) {
      model["grad." + n] = t.shape().dims();
    });
    acts.visit([&](const std::string& n, const teo::Tensor<double>& t) {
      model["act." + n] = t.shape().dims();
    });
    dacts.visit([&](const std::string& n, const teo::Tensor<double>& t) {
      model["grad.act." + n] = t.shape().dims();
    });
    const auto all = contract::model_case(cfg, sizes, false);
    for (const auto& t : all) {
      if (t.role == contract::Role::input || t.role == contract::Role::mask) continue;
      ASSERT_TRUE(model.contains(t.name)) << t.name;
      EXPECT_EQ(model.at(t.name), t.shape) << t.name << " " << t.symbolic();
    }
    // the model's activations, in its order, are the contract's full list
    std::vector<std::string> kept, listed_all;
    acts.visit([&](const std::string& n, const teo::Tensor<double>&) { kept.push_back(n); });
    for (const auto& t : contract::activations(cfg, sizes, /*in_golden=*/false))
      listed_all.push_back(t.name);
    EXPECT_EQ(kept, listed_all);
    std::set<std::string> listed;
    for (const auto& t : all) listed.insert(t.name);
    for (const auto& [n, shape] : model) {
      const bool in_decoder = n.starts_with("act.decoder.layers.");
      const bool left_out = n.ends_with(".ffn_gate") || n.ends_with(".ffn_pre") ||
                            n.ends_with(in_decoder ? ".residual3" : ".residual2");
      if (n.starts_with("grad.act.")) continue;  // the contract keeps only some of them
      EXPECT_EQ(listed.contains(n), !left_out) << n;
    }
    if (cfg.dropout > 0) {
      for (const auto& m : contract::masks(cfg, {B, S})) {
        const std::vector<std::uint8_t>* got = &acts.input_mask;
        if (m.name != "dropout.input") {
          const auto& l = acts.layers.at(std::stoul(m.name.substr(15, 1))).masks;
          got = m.name.ends_with(".attn")        ? &l.attn
                : m.name.ends_with(".residual1") ? &l.residual1
                : m.name.ends_with(".ffn")       ? &l.ffn
                                                 : &l.residual2;
        }
        EXPECT_EQ(static_cast<index_t>(got->size()), teo::Shape(m.shape).numel()) << m.name;
      }
    }
  }
}

TEST(Contract, SymbolicShapesOfGqaRopeAndSinks) {
  EXPECT_EQ(contract::symbolic(contract::dims_of("act.layers.0.q_rot")), "[B, H, S, Dh]");
  EXPECT_EQ(contract::symbolic(contract::dims_of("act.layers.3.k")), "[B, Hkv, S, Dh]");
  EXPECT_EQ(contract::symbolic(contract::dims_of("grad.act.layers.3.k_rot")), "[B, Hkv, S, Dh]");
  EXPECT_EQ(contract::symbolic(contract::dims_of("param.layers.1.attn.sinks")), "[H]");
  EXPECT_EQ(contract::symbolic(contract::dims_of("grad.layers.1.attn.k.weight")), "[Hkv*Dh, D]");
  EXPECT_EQ(contract::symbolic(contract::dims_of("ref64.act.loss")), "[]");
  EXPECT_EQ(contract::symbolic(contract::dims_of("dropout.layers.2.ffn")), "[B, S, F]");
  EXPECT_THROW(contract::dims_of("act.layers.0.nothing"), std::invalid_argument);
  EXPECT_THROW(contract::dims_of("param.layers.0.attn.sink"), std::invalid_argument);
  EXPECT_EQ(teo::golden::symbolic_shape("act.layers.0.q_rot"), "[B, H, S, Dh]");
  EXPECT_EQ(teo::golden::symbolic_shape("act.typo"), "?");
}

TEST(Contract, GradientsComeInTheOrderBackwardProducesThem) {
  ModelConfig cfg = configs()[2].second;  // GQA + RoPE + sinks, post-norm
  cfg.num_layers = 1;
  std::vector<std::string> names;
  for (const auto& t : contract::gradients(cfg, {2, 3})) names.push_back(t.name);
  const std::vector<std::string> want = {"grad.act.logits",
                                         "grad.head.weight",
                                         "grad.head.bias",
                                         "grad.act.pooled",
                                         "grad.act.layers.0.output",
                                         "grad.layers.0.norm2.weight",
                                         "grad.layers.0.norm2.bias",
                                         "grad.layers.0.ffn.fc2.weight",
                                         "grad.layers.0.ffn.fc2.bias",
                                         "grad.layers.0.ffn.fc1.weight",
                                         "grad.layers.0.ffn.fc1.bias",
                                         "grad.layers.0.norm1.weight",
                                         "grad.layers.0.norm1.bias",
                                         "grad.layers.0.attn.o.weight",
                                         "grad.layers.0.attn.o.bias",
                                         "grad.layers.0.attn.sinks",
                                         "grad.layers.0.attn.v.weight",
                                         "grad.layers.0.attn.v.bias",
                                         "grad.layers.0.attn.k.weight",
                                         "grad.layers.0.attn.k.bias",
                                         "grad.layers.0.attn.q.weight",
                                         "grad.layers.0.attn.q.bias",
                                         "grad.act.input",
                                         "grad.embedding.weight"};
  EXPECT_EQ(names, want);
}

// Every committed model and op case validates, holds every tensor its contract names (its file
// order is the contract's), and has grad.X for every param.X but a selection bias.
TEST(Contract, EveryCommittedCaseHoldsExactlyItsContract) {
  int model = 0, op = 0;
  for (const char* dir : {"golden", "golden/ops"}) {
    for (const auto& e : fs::directory_iterator(fs::path(TEO_SOURCE_DIR) / dir)) {
      if (e.path().extension() != ".safetensors") continue;
      SCOPED_TRACE(e.path().string());
      const st::File f = st::read(e.path().string());
      EXPECT_NO_THROW(teo::golden::validate(f));
      if (teo::golden::is_op_file(f)) {
        ++op;
        continue;
      }
      ++model;
      const auto c = teo::golden::case_of(f);
      const auto want = contract::model_case(c.config, c.sizes(), c.dtype == "float32");
      ASSERT_EQ(f.tensors.size(), want.size());
      // in the contract's order (a file orders its tensors by offset: empty ones tie)
      std::vector<std::string> got_order, want_order;
      for (const auto& t : f.tensors)
        if (t.numel() > 0) got_order.push_back(t.name);
      for (const auto& t : want)
        if (teo::Shape(t.shape).numel() > 0) want_order.push_back(t.name);
      EXPECT_EQ(got_order, want_order);
      for (const auto& t : f.tensors) {
        if (!t.name.starts_with("param.")) continue;
        // DeepSeek-V3's selection bias is for choosing only: no gradient reaches it, and the
        // contract has none (golden-format.md, "Mixture-of-experts layers")
        // and a quantized weight has none (docs/quantization.md, "Quantized models")
        const bool selection_only = t.name.ends_with(".moe.gate.e_score_correction_bias") ||
                                    teo::contract::is_quantized(c.config, t.name.substr(6));
        EXPECT_EQ(f.find("grad." + t.name.substr(6)) != nullptr, !selection_only) << t.name;
      }
    }
  }
  EXPECT_GE(model, 80);
  EXPECT_GE(op, 50);
}

// docs/golden-format.md's parameter and activation tables: each row's name (with {i} for a layer
// index) and shape is the contract's, and every tensor of the contract has its row.
TEST(Contract, DocsTablesAgreeWithTheContract) {
  const std::string doc = teo::test::slurp(fs::path(TEO_SOURCE_DIR) / "docs/golden-format.md");
  ASSERT_FALSE(doc.empty());
  // | `param.layers.{i}.attn.k.weight` (...) | `[Hkv*Dh, D]` | ...
  const std::regex row(R"(\n\| `((?:param|act)\.[a-z0-9_.{}]+)`[^|]*\| `(\[[^\]]*\])`)");
  std::map<std::string, std::string> documented;
  for (auto it = std::sregex_iterator(doc.begin(), doc.end(), row); it != std::sregex_iterator();
       ++it) {
    const std::string name = (*it)[1], shape = (*it)[2];
    const auto [at, fresh] = documented.emplace(name, shape);
    if (!fresh) {
      EXPECT_EQ(at->second, shape) << name << " is documented twice, differently";
    }
  }
  ASSERT_GE(documented.size(), 30u);
  std::set<std::string> in_contract;
  for (const auto& [what, cfg] : configs()) {
    for (const auto& t : contract::model_case(cfg, {2, 3}, false)) {
      if (t.role != contract::Role::param && t.role != contract::Role::act) continue;
      const std::string generic =
          std::regex_replace(t.name, std::regex(R"(layers\.\d+\.)"), "layers.{i}.");
      in_contract.insert(generic);
      ASSERT_TRUE(documented.contains(generic)) << generic << " has no row in the docs";
      EXPECT_EQ(documented.at(generic), t.symbolic()) << generic;
    }
  }
  for (const auto& [name, shape] : documented)
    EXPECT_TRUE(in_contract.contains(name)) << name << " is documented but not in the contract";
}

}  // namespace
