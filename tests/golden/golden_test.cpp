// The golden corpus and the checker: the corpus is reproduced bit for bit, covers what it
// promises and follows the naming contract; the checker's verdicts follow its documented rules;
// an independent naive backend passes; and every mutant fails at the stage where its bug lives.
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include "check_support.hpp"

#include "golden/naive_backend.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/golden.hpp"
#include "teo/sha256.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;
using nlohmann::json;

const fs::path kCorpus = fs::path(TEO_SOURCE_DIR) / "golden";

using teo::test::slurp;

const std::vector<golden::CorpusEntry>& corpus() {
  static const auto entries = golden::read_corpus_cases((kCorpus / "cases.json").string());
  return entries;
}

const st::File& committed(const std::string& name) {
  static std::map<std::string, st::File> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    it = cache.emplace(name, st::read((kCorpus / (name + ".safetensors")).string())).first;
  }
  return it->second;
}

// ---- the corpus ----------------------------------------------------------------------------

TEST(GoldenCorpus, ManifestMatchesTheCommittedFiles) {
  const json m = json::parse(slurp(kCorpus / "manifest.json"));
  ASSERT_EQ(m["files"].size(), corpus().size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < corpus().size(); ++i) {
    const auto& f = m["files"][i];
    EXPECT_EQ(f["file"], corpus()[i].name + ".safetensors");
    const std::string bytes = slurp(kCorpus / f["file"].get<std::string>());
    EXPECT_EQ(f["sha256"], teo::sha256_hex(bytes)) << f["file"];
    EXPECT_EQ(f["bytes"], bytes.size()) << f["file"];
    EXPECT_FALSE(f["description"].get<std::string>().empty());
    total += bytes.size();
  }
  EXPECT_GE(corpus().size(), 40u);
  // The model cases and the op cases (golden/ops) share one budget: a clone stays small, and a
  // new family of cases pays for itself by keeping its cases small (tiny widths, few layers).
  // 30 MB until the mixtures of experts (2026-12), whose op and model cases have 2 MB of it; 33 MB
  // since the quantized weights and caches (0.3 MB: a weight's exact values are a float tensor of
  // its own, and a K-quant row is 256 values at least); 34 MB since the quantized models (0.9 MB:
  // MXFP4's blocks of 32 widen gpt-oss's case to 32).
  const json ops = json::parse(slurp(kCorpus / "ops" / "manifest.json"));
  EXPECT_LE(total + ops["total_bytes"].get<std::uint64_t>(), 34u * 1000 * 1000)
      << "the corpus stays under 34 MB";
  EXPECT_EQ(m["total_bytes"], total);
}

// With 1 thread through make() and serialize() (the whole file in memory), with 2 through
// generate_file (the streaming writer `teo golden generate` uses): both give every committed file.
TEST(GoldenCorpus, RegeneratesBitForBitOnTheReferenceBackendWithOneAndTwoThreads) {
  const fs::path dir = fs::temp_directory_path() / ("teo_stream_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (int threads : {1, 2}) {
    teo::ScopedSettings keep;
    teo::set_backend(teo::Backend::reference);
    teo::set_num_threads(threads);
    for (const auto& e : corpus()) {
      const std::string path = (dir / (e.name + ".safetensors")).string();
      std::string bytes;
      if (threads == 1) {
        bytes = st::serialize(golden::make(e.spec));
      } else {
        golden::GenerateOptions opts;
        opts.overwrite = true;
        const std::uint64_t size = golden::generate_file(e.spec, path, opts);
        bytes = slurp(path);
        EXPECT_EQ(size, bytes.size()) << e.name;
      }
      EXPECT_TRUE(bytes == slurp(kCorpus / (e.name + ".safetensors")))
          << e.name << " differs from the committed file with " << threads << " thread(s)"
          << (threads == 2 ? ", streamed" : "");
    }
  }
  fs::remove_all(dir);
}

// The streamed file of a case that changes the header at the end (an ill-conditioned case's
// metadata) or keeps a subset (--keep) is make()'s, byte for byte; a stage that throws (an
// interruption) leaves no file and no temporary file, and an existing file untouched.
TEST(GoldenGenerateFile, StreamsMakesBytesAndLeavesNothingWhenStopped) {
  const fs::path dir = fs::temp_directory_path() / ("teo_genfile_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "c.safetensors").string();
  const auto files = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file() ? 1 : 0;
    return n;
  };
  const golden::Case ill = golden::test_support::ill_conditioned(corpus().front().spec);
  golden::GenerateOptions opts;
  opts.overwrite = true;
  opts.allow_ill_conditioned = true;
  golden::generate_file(ill, path, opts);
  const st::File want = golden::make(ill, true);
  ASSERT_NE(want.meta("ill_conditioned"), nullptr);
  EXPECT_TRUE(slurp(path) == st::serialize(want)) << "the moved header";
  opts.allow_ill_conditioned = false;
  EXPECT_THROW(golden::generate_file(ill, path, opts), teo::IllConditioned);
  EXPECT_TRUE(slurp(path) == st::serialize(want)) << "a refused case changes nothing";

  golden::Case c = corpus().front().spec;
  c.dtype = "float32";  // with its float64 reference run
  st::File kept = golden::make(c);
  golden::keep_only(kept, "act.layers.*.output,grad.embedding.*");
  opts.keep = "act.layers.*.output,grad.embedding.*";
  golden::generate_file(c, path, opts);
  EXPECT_TRUE(slurp(path) == st::serialize(kept));

  const std::string before = slurp(path);
  std::vector<std::string> stages;
  opts.keep.clear();
  opts.progress = [&](const std::string& stage) {
    stages.push_back(stage);
    if (stage.starts_with("writing the float64")) throw teo::Interrupted("stop");
  };
  EXPECT_THROW(golden::generate_file(c, path, opts), teo::Interrupted);
  EXPECT_TRUE(slurp(path) == before) << "the file under the final name is untouched";
  EXPECT_EQ(files(), 1) << "the temporary file is gone";
  fs::remove(path);
  opts.overwrite = false;
  EXPECT_THROW(golden::generate_file(c, path, opts), teo::Interrupted);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_EQ(files(), 0);
  ASSERT_GE(stages.size(), 4u);
  EXPECT_EQ(stages.front(), "float32 forward and backward");
  // a stop between two tensors (poll), in the float32 run's and in the reference's
  for (int at : {5, 40}) {
    int polls = 0;
    opts.progress = nullptr;
    opts.poll = [&] {
      if (++polls == at) throw teo::Interrupted("stop");
    };
    EXPECT_THROW(golden::generate_file(c, path, opts), teo::Interrupted) << at;
    EXPECT_FALSE(fs::exists(path));
    EXPECT_EQ(files(), 0);
  }
  fs::remove_all(dir);
}

// The simd backend (every ISA this CPU runs) and the blas backend: each gives the same bytes on
// 1 and 2 threads (simd: on every ISA too), and what it gives passes the check against the
// committed corpus.
TEST(GoldenCorpus, EveryBackendAndIsaIsDeterministicAndPassesTheCheck) {
  struct Setting {
    teo::Backend backend;
    teo::Isa isa;
  };
  std::vector<Setting> settings;
  for (teo::Isa isa : teo::supported_isas()) settings.push_back({teo::Backend::simd, isa});
  settings.push_back({teo::Backend::blas, teo::best_isa()});
  for (const auto& e : corpus()) {
    std::string simd_bytes;
    for (const auto& s : settings) {
      std::string first;
      for (int threads : {1, 2}) {
        teo::ScopedSettings keep;
        teo::set_backend(s.backend);
        teo::set_isa(s.isa);
        teo::set_num_threads(threads);
        const std::string bytes = st::serialize(golden::make(e.spec));
        const std::string where = e.name + " on " + teo::to_string(s.backend) + "/" +
                                  teo::to_string(s.isa) + " with " + std::to_string(threads) +
                                  " thread(s)";
        if (threads == 1) {
          first = bytes;
          const auto rep = golden::check(committed(e.name), st::parse(bytes, where), {});
          EXPECT_EQ(rep.failed, 0) << where << ": first divergence " << rep.first_divergence;
          EXPECT_EQ(rep.not_checked, 0) << where;
        } else {
          EXPECT_TRUE(bytes == first) << where << " differs from 1 thread";
        }
        if (s.backend == teo::Backend::simd) {
          if (simd_bytes.empty()) simd_bytes = bytes;
          EXPECT_TRUE(bytes == simd_bytes) << where << " differs from the first ISA";
        }
      }
    }
  }
}

TEST(GoldenCorpus, CoversEveryFeature) {
  std::set<std::string> seen;
  for (const auto& e : corpus()) {
    const auto& c = e.spec.config;
    seen.insert(e.spec.dtype);
    seen.insert(c.norms.norm_first ? "pre" : "post");
    seen.insert(teo::to_string(c.ffn.activation));
    seen.insert(std::string("pool:") + teo::to_string(c.head.pooling));
    seen.insert(std::string("pe:") + teo::to_string(c.embeddings.positional));
    if (c.embeddings.embed_scale) seen.insert("embed_scale");
    if (c.attention.causal) seen.insert("causal");
    if (c.head.label_smoothing > 0) seen.insert("label_smoothing");
    if (c.dropout > 0) seen.insert("dropout");
    const auto lens = e.spec.case_json()["lengths"].get<std::vector<std::int64_t>>();
    std::set<std::int64_t> distinct(lens.begin(), lens.end());
    for (auto l : lens) {
      if (l == 0) seen.insert("len0");
      if (l == 1) seen.insert("len1");
      if (l == e.spec.seq_len) seen.insert("lenfull");
    }
    if (distinct.size() > 1) seen.insert("mixed");
    if (e.spec.seq_len == 1) seen.insert("seq1");
    if (e.spec.seq_len == 113) seen.insert("seq113");
    if ((c.d_model & (c.d_model - 1)) != 0) seen.insert("d_model_not_pow2");
    if (c.attention.num_heads == 1) seen.insert("one_head");
    if (c.d_head() % 2 == 1) seen.insert("odd_d_head");
    seen.insert("layers" + std::to_string(c.num_layers));
    if (e.spec.batch == 0) seen.insert("batch0");
    // the attention variants (docs/semantics.md section 14)
    const teo::index_t kv = c.kv_heads();
    if (kv == 1 && c.attention.num_heads > 1) seen.insert("mqa");
    if (kv > 1 && kv < c.attention.num_heads)
      seen.insert(c.attention.num_heads / kv == 3 ? "gqa_ratio3" : "gqa");
    if (c.embeddings.positional == teo::Positional::rope) {
      seen.insert(std::string("rope:") + teo::to_string(c.attention.rope_style));
      seen.insert(std::string("rope_scaling:") + teo::to_string(c.attention.rope_scaling.type));
      if (c.rotary() < c.d_head()) seen.insert("rope:partial");
      if (c.embeddings.position_offset >= 100000) seen.insert("rope:offset1e5");
    }
    if (c.embeddings.position_offset > 0 && c.embeddings.positional == teo::Positional::learned)
      seen.insert("learned_offset");
    if (c.embeddings.positional == teo::Positional::alibi)
      seen.insert(c.attention.causal ? "alibi:causal" : "alibi:bi");
    if (c.attention.sliding_window) {
      const teo::index_t w = *c.attention.sliding_window, s = e.spec.seq_len;
      seen.insert(w == 1       ? "window:1"
                  : w == s - 1 ? "window:S-1"
                  : w == s     ? "window:S"
                  : w == s + 3 ? "window:S+3"
                               : "window:other");
      if (!c.attention.causal && w > 1 && w < s) seen.insert("window:bidirectional");
    }
    if (c.attention.attn_logit_softcap) seen.insert("softcap");
    const bool has_len0 = std::find(lens.begin(), lens.end(), 0) != lens.end();
    if (c.attention.attn_sinks && has_len0) seen.insert("sinks");
    if (c.attention.num_kv_heads && c.embeddings.positional == teo::Positional::rope &&
        c.attention.sliding_window && c.attention.attn_logit_softcap && c.attention.attn_sinks)
      seen.insert("every_variant");
    if (c.attention.qk_norm) seen.insert("qk_norm");
    if (c.attention.head_dim && c.attn_width() != c.d_model) seen.insert("head_dim");
    if (e.spec.drawn_norms) seen.insert("drawn_norms");
    const auto& types = c.attention.layer_types;
    if (std::ranges::count(types, teo::LayerAttention::full) > 0 &&
        std::ranges::count(types, teo::LayerAttention::sliding) > 0)
      seen.insert("layer_types");
    if (!c.attention.rope_scaling.truncate) seen.insert("yarn_untruncated");
    // the block variants and decoders (docs/semantics.md, section 17)
    seen.insert(std::string("norm:") + teo::to_string(c.norms.norm));
    seen.insert(std::string("ffn:") + teo::to_string(c.ffn.kind));
    if (!c.attention.attn_bias && !c.ffn.ffn_bias && !c.head.head_bias) seen.insert("no_biases");
    if (c.decoder()) {
      seen.insert(c.head.tie_embeddings ? "decoder:tied" : "decoder:untied");
      seen.insert(c.norms.norm_first ? "decoder:pre" : "decoder:post");
      if (e.spec.precision)
        seen.insert(std::string("decoder:") + teo::to_string(*e.spec.precision));
      // a sequence of length 0 or 1 has no target; a batch may have none at all
      if (std::any_of(lens.begin(), lens.end(), [](auto l) { return l <= 1; }))
        seen.insert("decoder:no_target_sequence");
      if (std::all_of(lens.begin(), lens.end(), [](auto l) { return l <= 1; }))
        seen.insert("decoder:no_target_at_all");
    } else if (c.encoder_decoder()) {
      seen.insert(c.norms.norm_first ? "seq2seq:pre" : "seq2seq:post");
      seen.insert(c.embeddings.decoder_vocab_size ? "seq2seq:own_vocab" : "seq2seq:shared_vocab");
      if (c.head.tie_embeddings) seen.insert("seq2seq:tied");
      if (c.dec_layers() != c.num_layers) seen.insert("seq2seq:decoder_layers");
      if (has_len0) seen.insert("seq2seq:source_length0");
      const auto tl = e.spec.case_json()["tgt_lengths"].get<std::vector<std::int64_t>>();
      if (std::find(tl.begin(), tl.end(), 0) != tl.end()) seen.insert("seq2seq:empty_target");
      if (e.spec.dtype == "float32") seen.insert("seq2seq:float32");
    } else if (c.norms.norm == teo::Norm::rmsnorm) {
      seen.insert("encoder:rmsnorm");
    }
    // the real encoders of semantics 18, each in float64, float32 (and BERT and ViT in bf16)
    const std::string kind = e.spec.precision ? teo::to_string(*e.spec.precision) : e.spec.dtype;
    if (c.embeddings.type_vocab_size && c.embeddings.embedding_norm &&
        c.head.pooler == teo::Pooler::dense_tanh)
      seen.insert((c.embeddings.padding_idx == 1 && c.embeddings.position_offset == 2 ? "roberta:"
                                                                                      : "bert:") +
                  kind);
    if (c.patches_input()) seen.insert("vit:" + kind);
    if (e.spec.steps > 0) {
      const auto has = [&](std::int64_t n) {
        return std::find(lens.begin(), lens.end(), n) != lens.end();
      };
      if (has(0)) seen.insert("generate:prompt0");
      if (has(1)) seen.insert("generate:prompt1");
      if (has(7)) seen.insert("generate:prompt7");
      if (e.spec.precision)
        seen.insert("generate:" + std::string(teo::to_string(*e.spec.precision)));
    }
  }
  for (const char* want : {"float32",
                           "float64",
                           "bert:float64",
                           "bert:float32",
                           "bert:bf16",
                           "bert:fp8",
                           "roberta:float64",
                           "roberta:float32",
                           "vit:float64",
                           "vit:float32",
                           "vit:bf16",
                           "vit:fp8",
                           "pre",
                           "post",
                           "relu",
                           "gelu",
                           "gelu_tanh",
                           "pool:mean",
                           "pool:cls",
                           "pool:max",
                           "pe:sinusoidal",
                           "pe:learned",
                           "embed_scale",
                           "causal",
                           "label_smoothing",
                           "dropout",
                           "len0",
                           "len1",
                           "lenfull",
                           "mixed",
                           "seq1",
                           "seq113",
                           "d_model_not_pow2",
                           "one_head",
                           "odd_d_head",
                           "batch0",
                           "layers0",
                           "layers1",
                           "layers2",
                           "layers3",
                           "pe:none",
                           "pe:rope",
                           "pe:alibi",
                           "mqa",
                           "gqa",
                           "gqa_ratio3",
                           "rope:neox",
                           "rope:interleaved",
                           "rope:partial",
                           "rope:offset1e5",
                           "rope_scaling:linear",
                           "rope_scaling:ntk",
                           "rope_scaling:yarn",
                           "learned_offset",
                           "alibi:causal",
                           "alibi:bi",
                           "window:1",
                           "window:S-1",
                           "window:S",
                           "window:S+3",
                           "window:bidirectional",
                           "softcap",
                           "sinks",
                           "every_variant",
                           "qk_norm",
                           "head_dim",
                           "drawn_norms",
                           "layer_types",
                           "yarn_untruncated",
                           "norm:layernorm",
                           "norm:rmsnorm",
                           "ffn:mlp",
                           "ffn:swiglu",
                           "ffn:geglu",
                           "no_biases",
                           "decoder:tied",
                           "decoder:untied",
                           "decoder:pre",
                           "decoder:post",
                           "decoder:bf16",
                           "decoder:fp16",
                           "decoder:fp8",
                           "decoder:no_target_sequence",
                           "decoder:no_target_at_all",
                           "encoder:rmsnorm",
                           "seq2seq:pre",
                           "seq2seq:post",
                           "seq2seq:own_vocab",
                           "seq2seq:shared_vocab",
                           "seq2seq:tied",
                           "seq2seq:decoder_layers",
                           "seq2seq:source_length0",
                           "seq2seq:empty_target",
                           "seq2seq:float32",
                           "generate:prompt0",
                           "generate:prompt1",
                           "generate:prompt7",
                           "generate:bf16"}) {
    EXPECT_TRUE(seen.count(want)) << "no case covers " << want;
  }
}

// A case with drawn_norms has every norm's weight and bias drawn, each norm its own values (a
// backend that reads one norm's weight for another's must fail): none is PyTorch's 1 or 0.
TEST(GoldenCorpus, DrawnNormsAreDrawnAndDistinct) {
  int cases = 0;
  for (const auto& e : corpus()) {
    if (!e.spec.drawn_norms) continue;
    ++cases;
    const st::File& g = committed(e.name);
    std::set<std::vector<double>> weights;
    int norms = 0;
    for (const auto& t : g.tensors) {
      if (!t.name.starts_with("param.") || t.name.find("norm") == std::string::npos) continue;
      ++norms;
      const auto v = t.float_values();
      const double base = t.name.ends_with(".weight") ? 1.0 : 0.0;
      for (double x : v) {
        EXPECT_NE(x, base) << e.name << " " << t.name;
        EXPECT_LE(std::abs(x - base), 0.5) << e.name << " " << t.name;
      }
      EXPECT_TRUE(weights.insert(v).second) << e.name << " " << t.name << " repeats another norm";
    }
    EXPECT_GE(norms, 3) << e.name;
  }
  EXPECT_GE(cases, 1);
  teo::ModelConfig cfg;
  nlohmann::json j = cfg.to_json();
  j["case"] = {
      {"batch", 1}, {"seq_len", 2}, {"dtype", "float64"}, {"seed", 1u}, {"drawn_norms", 1}};
  EXPECT_THROW(golden::Case::from_json(j), teo::ConfigError);
  j["case"]["drawn_norms"] = true;
  EXPECT_TRUE(golden::Case::from_json(j).case_json().at("drawn_norms").get<bool>());
}

// The naming contract of docs/golden-format.md, checked on a dropout case with 2 layers.
TEST(GoldenCorpus, FilesFollowTheNamingContract) {
  const st::File& f = committed("dropout_post_f32");
  const auto& e = *std::find_if(corpus().begin(), corpus().end(),
                                [](const auto& x) { return x.name == "dropout_post_f32"; });
  const auto& c = e.spec.config;
  const std::int64_t B = e.spec.batch, S = e.spec.seq_len, D = c.d_model, H = c.attention.num_heads,
                     Dh = c.d_head(), F = c.ffn.d_ff, C = c.head.num_classes;
  EXPECT_EQ(*f.meta("format"), "teo-golden/1");
  EXPECT_EQ(teo::ModelConfig::from_json_text(*f.meta("config")), c);
  EXPECT_EQ(json::parse(*f.meta("case")), e.spec.case_json());
  EXPECT_EQ(*f.meta("teo_version"), TEO_VERSION);
  using D_ = st::DType;
  const std::vector<std::tuple<std::string, D_, std::vector<std::int64_t>>> want = {
      {"input.tokens", D_::I64, {B, S}},
      {"input.lengths", D_::I64, {B}},
      {"input.labels", D_::I64, {B}},
      {"param.embedding.weight", D_::F32, {c.embeddings.vocab_size, D}},
      {"param.layers.1.ffn.fc1.weight", D_::F32, {F, D}},
      {"param.head.bias", D_::F32, {C}},
      {"dropout.input", D_::U8, {B, S, D}},
      {"dropout.layers.1.attn", D_::U8, {B, H, S, S}},
      {"dropout.layers.0.residual1", D_::U8, {B, S, D}},
      {"dropout.layers.0.ffn", D_::U8, {B, S, F}},
      {"dropout.layers.1.residual2", D_::U8, {B, S, D}},
      {"act.embedding", D_::F32, {B, S, D}},
      {"act.positional", D_::F32, {S, D}},
      {"act.input", D_::F32, {B, S, D}},
      {"act.layers.0.q", D_::F32, {B, H, S, Dh}},
      {"act.layers.0.scores", D_::F32, {B, H, S, S}},
      {"act.layers.0.probs", D_::F32, {B, H, S, S}},
      {"act.layers.1.context", D_::F32, {B, S, D}},
      {"act.layers.1.ffn_hidden", D_::F32, {B, S, F}},
      {"act.layers.1.output", D_::F32, {B, S, D}},
      {"act.pooled", D_::F32, {B, D}},
      {"act.logits", D_::F32, {B, C}},
      {"act.loss", D_::F32, {}},
      {"grad.act.logits", D_::F32, {B, C}},
      {"grad.act.pooled", D_::F32, {B, D}},
      {"grad.act.layers.0.output", D_::F32, {B, S, D}},
      {"grad.act.input", D_::F32, {B, S, D}},
      {"grad.layers.0.attn.q.weight", D_::F32, {D, D}},
      {"grad.embedding.weight", D_::F32, {c.embeddings.vocab_size, D}},
      {"ref64.act.layers.0.probs", D_::F64, {B, H, S, S}},
      {"ref64.grad.embedding.weight", D_::F64, {c.embeddings.vocab_size, D}},
  };
  for (const auto& [name, dtype, shape] : want) {
    const auto* t = f.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, dtype) << name;
    EXPECT_EQ(t->shape, shape) << name;
  }
  // Every act./grad. tensor has its ref64 twin, and nothing else is there.
  for (const auto& t : f.tensors) {
    const bool known = t.name.starts_with("input.") || t.name.starts_with("param.") ||
                       t.name.starts_with("dropout.") || t.name.starts_with("act.") ||
                       t.name.starts_with("grad.") || t.name.starts_with("ref64.");
    EXPECT_TRUE(known) << t.name;
    if (t.name.starts_with("act.") || t.name.starts_with("grad.")) {
      EXPECT_NE(f.find("ref64." + t.name), nullptr) << t.name;
    }
    EXPECT_EQ(t.name.find("ffn_pre"), std::string::npos) << "not part of the contract";
  }
  // Masked scores are stored as -inf: batch 2 has length 2, so key 5 is masked for every query.
  const auto scores = f.find("act.layers.0.scores")->values<float>();
  const auto lengths = f.find("input.lengths")->values<std::int64_t>();
  ASSERT_EQ(lengths[2], 2);
  EXPECT_EQ(scores[static_cast<std::size_t>(((2 * H + 0) * S + 0) * S + 5)],
            -std::numeric_limits<float>::infinity());
  // A float64 golden has no ref64 tensors and no masks without dropout.
  const st::File& g64 = committed("post_gelu_mean_f64");
  for (const auto& t : g64.tensors) {
    EXPECT_FALSE(t.name.starts_with("ref64.")) << t.name;
    EXPECT_FALSE(t.name.starts_with("dropout.")) << t.name;
  }
}

// ---- the checker ---------------------------------------------------------------------------

// A copy of the golden's act./grad. tensors: the candidate a perfect backend would write.
st::File candidate_of(const st::File& g) {
  st::File c;
  for (const auto& t : g.tensors) {
    if (t.name.starts_with("act.") || t.name.starts_with("grad.")) c.tensors.push_back(t);
  }
  return c;
}

st::Tensor* tensor(st::File& f, const std::string& name) {
  for (auto& t : f.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

template <class T>
void set_value(st::Tensor& t, std::size_t i, T v) {
  std::memcpy(t.bytes.data() + i * sizeof(T), &v, sizeof(T));
}

template <class T>
T get_value(const st::Tensor& t, std::size_t i) {
  T v;
  std::memcpy(&v, t.bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}

const golden::TensorResult& result(const golden::CaseReport& r, const std::string& name) {
  for (const auto& t : r.tensors) {
    if (t.name == name) return t;
  }
  throw std::runtime_error("no result for " + name);
}

TEST(GoldenCheck, TheGoldenPassesAgainstItselfInPipelineOrder) {
  for (const char* name : {"post_gelu_mean_f64", "dropout_post_f32"}) {
    const auto rep = golden::check(committed(name), candidate_of(committed(name)), {});
    EXPECT_EQ(rep.failed, 0);
    EXPECT_EQ(rep.not_checked, 0);
    EXPECT_TRUE(rep.first_divergence.empty());
    ASSERT_FALSE(rep.tensors.empty());
    EXPECT_EQ(rep.tensors.front().name, "act.embedding");
    // forward first (embedding ... loss), then backward from the logits to the embedding
    std::size_t loss = 0, glogits = 0, gemb = 0;
    for (std::size_t i = 0; i < rep.tensors.size(); ++i) {
      if (rep.tensors[i].name == "act.loss") loss = i;
      if (rep.tensors[i].name == "grad.act.logits") glogits = i;
      if (rep.tensors[i].name == "grad.embedding.weight") gemb = i;
    }
    EXPECT_EQ(glogits, loss + 1);
    EXPECT_EQ(gemb, rep.tensors.size() - 1);
  }
}

TEST(GoldenCheck, Float64ToleranceIsRtolTimesMaxPlusAtol) {
  const st::File& g = committed("post_gelu_mean_f64");
  const std::string name = "act.layers.0.attn_out";
  const auto* gt = g.find(name);
  const auto v = gt->values<double>();
  double mx = 0;
  for (double x : v) mx = std::max(mx, std::abs(x));
  golden::CheckOptions opts;
  const double bound = opts.rtol * mx + opts.atol;
  for (double factor : {0.5, 1.5}) {
    st::File c = candidate_of(g);
    set_value<double>(*tensor(c, name), 3, v[3] + factor * bound);
    const auto rep = golden::check(g, c, opts);
    const auto& r = result(rep, name);
    EXPECT_NEAR(r.bound, bound, 1e-6 * bound);
    EXPECT_NEAR(r.ratio, factor, 1e-3);
    if (factor < 1) {
      EXPECT_EQ(r.status, golden::Status::pass);
      EXPECT_EQ(rep.failed, 0);
    } else {
      EXPECT_EQ(r.status, golden::Status::fail);
      EXPECT_EQ(rep.first_divergence, "layers.0.attn_out");
      EXPECT_EQ(rep.failed, 1) << "only the perturbed tensor fails";
      EXPECT_NE(r.message.find("[0,0,3]"), std::string::npos) << r.message;
    }
  }
}

TEST(GoldenCheck, Float32BoundFollowsTeosOwnErrorAgainstRef64) {
  const st::File& g = committed("post_gelu_mean_f32");
  const std::string name = "act.layers.1.ffn_out";
  const auto gv = g.find(name)->values<float>();
  const auto ref = g.find("ref64." + name)->values<double>();
  double teo_err = 0, mx = 0;
  for (std::size_t i = 0; i < gv.size(); ++i) {
    teo_err = std::max(teo_err, std::abs(double(gv[i]) - ref[i]));
    mx = std::max(mx, std::abs(ref[i]));
  }
  ASSERT_GT(teo_err, 0) << "float32 rounding is measurable";
  golden::CheckOptions opts;
  const double bound = opts.k * teo_err + opts.floor_eps * FLT_EPSILON * mx;
  const auto rep = golden::check(g, candidate_of(g), opts);
  EXPECT_NEAR(result(rep, name).bound, bound, 1e-9 * bound);
  // An error of twice the bound fails; a candidate equal to ref64 rounded passes.
  st::File c = candidate_of(g);
  set_value<float>(*tensor(c, name), 0, static_cast<float>(ref[0] + 2 * bound));
  EXPECT_EQ(result(golden::check(g, c, opts), name).status, golden::Status::fail);
  st::File r = candidate_of(g);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    set_value<float>(*tensor(r, name), i, static_cast<float>(ref[i]));
  }
  EXPECT_EQ(result(golden::check(g, r, opts), name).status, golden::Status::pass);
}

// A missing tensor is not checked; an extra one fails (a misspelling must not pass unseen),
// unless allow_extra accepts it.
TEST(GoldenCheck, MissingTensorsAreNotCheckedAndExtraOnesFailUnlessAllowed) {
  const st::File& g = committed("pre_gelu_mean_f64");
  st::File c = candidate_of(g);
  c.tensors.erase(c.tensors.begin() + 2);
  const std::vector<double> extra = {1, 2};
  c.add<double>("act.something_else", {2}, extra.data(), 2);
  auto rep = golden::check(g, c, {});
  EXPECT_EQ(rep.failed, 1);
  EXPECT_EQ(rep.unknown, 1);
  EXPECT_EQ(rep.first_divergence, "") << "a stray name is not a stage that diverged";
  EXPECT_EQ(rep.tensors.back().name, "act.something_else");
  EXPECT_FALSE(rep.tensors.back().compared);
  golden::CheckOptions allow;
  allow.allow_extra = true;
  rep = golden::check(g, c, allow);
  EXPECT_EQ(rep.failed, 0);
  EXPECT_EQ(rep.extra, std::vector<std::string>{"act.something_else"});
  EXPECT_EQ(rep.not_checked, 1);
  EXPECT_EQ(rep.passed + 1, static_cast<int>(rep.tensors.size()));
  EXPECT_EQ(rep.tensors[2].status, golden::Status::not_checked);
  // A candidate with no tensors checks nothing and passes nothing.
  const auto none = golden::check(g, st::File{}, {});
  EXPECT_EQ(none.passed, 0);
  EXPECT_EQ(none.not_checked, static_cast<int>(none.tensors.size()));
}

TEST(GoldenCheck, DtypeAndShapeMismatchesFail) {
  const st::File& g = committed("post_gelu_mean_f64");
  st::File c = candidate_of(g);
  auto* t = tensor(c, "act.pooled");
  t->shape = {t->shape[1], t->shape[0]};
  auto rep = golden::check(g, c, {});
  EXPECT_EQ(result(rep, "act.pooled").status, golden::Status::fail);
  EXPECT_NE(result(rep, "act.pooled").message.find("shape mismatch"), std::string::npos);
  EXPECT_EQ(rep.first_divergence, "pooled");
  st::File d = candidate_of(g);
  auto* l = tensor(d, "act.loss");
  const float f = static_cast<float>(get_value<double>(*l, 0));
  l->dtype = st::DType::F32;
  l->bytes.resize(4);
  set_value<float>(*l, 0, f);
  rep = golden::check(g, d, {});
  EXPECT_NE(result(rep, "act.loss").message.find("dtype mismatch"), std::string::npos);
}

TEST(GoldenCheck, NonFiniteValuesMustMatchExactly) {
  const st::File& g = committed("post_gelu_mean_f64");
  const std::string name = "act.layers.0.scores";
  const auto v = g.find(name)->values<double>();
  std::size_t masked = 0, finite = 0;
  while (std::isfinite(v[masked])) ++masked;
  while (!std::isfinite(v[finite])) ++finite;
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Edit {
    std::size_t at;
    double value;
    bool passes;
  };
  for (const Edit& e :
       {Edit{masked, -inf, true}, Edit{masked, inf, false}, Edit{masked, -1e300, false},
        Edit{masked, nan, false}, Edit{finite, nan, false}, Edit{finite, inf, false}}) {
    st::File c = candidate_of(g);
    set_value<double>(*tensor(c, name), e.at, e.value);
    const auto rep = golden::check(g, c, {});
    const auto& r = result(rep, name);
    EXPECT_EQ(r.status == golden::Status::pass, e.passes) << e.at << " := " << e.value;
    if (!e.passes) {
      EXPECT_NE(r.message.find("NaN/Inf mismatch"), std::string::npos) << r.message;
    }
  }
}

TEST(GoldenCheck, OnlyForwardOrBackward) {
  const st::File& g = committed("post_gelu_mean_f64");
  golden::CheckOptions fwd, bwd;
  fwd.only = golden::Only::forward;
  bwd.only = golden::Only::backward;
  for (const auto& t : golden::check(g, candidate_of(g), fwd).tensors) {
    EXPECT_TRUE(t.name.starts_with("act.")) << t.name;
  }
  for (const auto& t : golden::check(g, candidate_of(g), bwd).tensors) {
    EXPECT_TRUE(t.name.starts_with("grad.")) << t.name;
  }
}

TEST(GoldenCheck, RejectsAGoldenThatIsNotOne) {
  st::File notgolden = candidate_of(committed("post_gelu_mean_f64"));
  EXPECT_THROW(golden::check(notgolden, notgolden, {}), teo::FormatError);
  st::File noref = committed("post_gelu_mean_f32");
  noref.tensors.erase(
      std::remove_if(noref.tensors.begin(), noref.tensors.end(),
                     [](const st::Tensor& t) { return t.name == "ref64.act.layers.0.probs"; }),
      noref.tensors.end());
  EXPECT_THROW(golden::check(noref, candidate_of(noref), {}), teo::FormatError);
}

TEST(GoldenCheck, ReportsParseAndCountTheSameThings) {
  const st::File& g = committed("post_gelu_mean_f64");
  st::File c = candidate_of(g);
  set_value<double>(*tensor(c, "act.logits"), 0, 1e3);
  c.tensors.erase(c.tensors.begin());
  golden::CaseReport rep = golden::check(g, c, {});
  rep.name = "post_gelu_mean_f64.safetensors";
  const json j = json::parse(golden::json_report({rep}));
  EXPECT_EQ(j["failed"], rep.failed);
  EXPECT_EQ(j["not_checked"], 1);
  EXPECT_EQ(j["cases"][0]["first_divergence"], "logits");
  const std::string xml = golden::junit_xml({rep});
  EXPECT_NE(xml.find("failures=\"" + std::to_string(rep.failed) + "\""), std::string::npos);
  EXPECT_NE(xml.find("<skipped"), std::string::npos);
  EXPECT_NE(xml.find("name=\"act.logits\"><failure"), std::string::npos);
  std::ostringstream text;
  golden::print_text({rep}, text);
  EXPECT_NE(text.str().find("first divergence: logits"), std::string::npos);
}

// ---- an independent backend and the mutants ------------------------------------------------

// The naive backend covers the encoder and decoder architectures with a dense FFN. An
// encoder_decoder's cases are checked independently by PyTorch (tests/interop: every tensor, and
// the stacks' outputs against nn.Transformer), and so are the mixture-of-experts cases
// (torch_backend.py's MoE, Interop.PyTorchCandidatesPassTheGoldenCheck, with its mutants in
// Interop.PyTorchMoeMutantsFailAtTheirTensor), and those with q and k norms (qk_norm), heads
// apart from d_model (head_dim), per-layer attention (layer_types) or YaRN's fractional range
// (truncate false), not here.
bool naive_covers(const golden::CorpusEntry& e) {
  const teo::ModelConfig& c = e.spec.config;
  return !c.encoder_decoder() && !c.moe() && !c.attention.qk_norm && !c.attention.head_dim &&
         c.attention.layer_types.empty() && c.attention.rope_scaling.truncate;
}

TEST(GoldenNaiveBackend, AgreesWithEveryCaseForward) {
  golden::CheckOptions fwd;
  fwd.only = golden::Only::forward;
  for (const auto& e : corpus()) {
    if (!naive_covers(e)) continue;
    const st::File& g = committed(e.name);
    golden::CheckOptions opts = fwd;
    if (e.spec.precision) opts.precision = teo::Precision::fp32;  // a float computation
    const auto rep = golden::check(g, teo::testing::naive_forward(g), opts);
    EXPECT_EQ(rep.failed, 0) << e.name << ": first divergence " << rep.first_divergence;
    EXPECT_EQ(rep.not_checked, 0) << e.name;
  }
}

// The naive backward (plain double loops, no code shared with src/) against every case's grad.*
// and grad.act.* tensors: a second independent check of the corpus's gradients besides PyTorch.
TEST(GoldenNaiveBackend, IndependentBackwardPassesEveryCase) {
  struct Worst {
    double ratio = 0, rel = 0;
    std::string where;
    int tensors = 0, cases = 0;
  };
  std::map<std::string, Worst> worst;  // per dtype
  int grad_tensors = 0;
  for (const auto& e : corpus()) {
    if (!naive_covers(e)) continue;
    const st::File& g = committed(e.name);
    // a float computation: a precision case's is judged by the float32 rule, not its precision's
    golden::CheckOptions plain;
    if (e.spec.precision) plain.precision = teo::Precision::fp32;
    const auto rep = golden::check(g, teo::testing::naive_candidate(g), plain);
    EXPECT_EQ(rep.failed, 0) << e.name << ": first divergence " << rep.first_divergence;
    EXPECT_EQ(rep.not_checked, 0) << e.name;
    int grads = 0;
    for (const auto& t : rep.tensors) {
      if (!t.name.starts_with("grad.")) continue;
      ++grads;
      EXPECT_EQ(t.status, golden::Status::pass) << e.name << " " << t.name << ": " << t.message;
      Worst& w = worst[e.spec.dtype];
      ++w.tensors;
      if (t.ratio > w.ratio) {
        w.ratio = t.ratio;
        w.rel = t.max_rel;
        w.where = e.name + " " + t.name;
      }
    }
    // Every parameter's gradient and grad.act.{logits, pooled, layers.*.output, input}.
    EXPECT_GE(grads, 7) << e.name;
    ++worst[e.spec.dtype].cases;
    grad_tensors += grads;
  }
  EXPECT_GT(grad_tensors, 1000);
  for (const auto& [dtype, w] : worst) {
    std::cout << "[ measured ] naive double backward, " << dtype
              << " cases: worst gradient err/bound " << w.ratio << " (max_rel " << w.rel << ", "
              << w.where << "); " << w.tensors << " gradient tensors over " << w.cases
              << " cases\n";
  }
}

// A mutation, the case it is checked on (without the _f64 / _f32 suffix) and the first stage that
// must fail.
struct Mutant {
  teo::testing::Mutation mutation;
  const char* case_name;
  const char* stage;
};

// Checks the mutant's candidate (the forward only, or forward and backward) on both dtypes of its
// case: it must fail, first at its stage. Returns the reports for further checks.
std::vector<golden::CaseReport> expect_mutant_fails_at_its_stage(const Mutant& m, bool backward) {
  std::vector<golden::CaseReport> reports;
  for (const char* suffix : {"_f64", "_f32"}) {
    const std::string name = std::string(m.case_name) + suffix;
    const std::string what = std::string(teo::testing::mutation_name(m.mutation)) + " on " + name;
    const st::File& g = committed(name);
    const auto candidate = backward ? teo::testing::naive_candidate(g, m.mutation)
                                    : teo::testing::naive_forward(g, m.mutation);
    auto rep = golden::check(g, candidate, {});
    EXPECT_GT(rep.failed, 0) << what;
    EXPECT_EQ(rep.first_divergence, m.stage) << what;
    rep.name = what;
    reports.push_back(std::move(rep));
  }
  return reports;
}

// Backward-only bugs: the forward still passes, and the first failing tensor is the first
// gradient, in the golden's order, that the wrong formula feeds.
TEST(GoldenMutants, BackwardMutantsFailAtTheGradientWhereTheirBugLives) {
  using M = teo::testing::Mutation;
  const std::vector<Mutant> mutants = {
      // Pre-norm: the first LayerNorm backward is the final norm's; its weight and bias gradients
      // do not use the missing term, its input gradient grad.act.layers.1.output does.
      {M::layer_norm_backward_no_mean, "pre_gelu_mean", "grad.act.layers.1.output"},
      // Post-norm: layer 1's LN2 (after its own weight and bias gradients); its input gradient
      // g_residual2 is first read by fc2's weight gradient.
      {M::layer_norm_backward_no_mean, "post_gelu_mean", "grad.layers.1.ffn.fc2.weight"},
      // The softmax backward feeds q and k; in the golden's order (o, v, k, q) k.weight is first.
      {M::softmax_backward_no_row_sum, "post_gelu_mean", "grad.layers.1.attn.k.weight"},
      {M::softmax_backward_no_row_sum, "causal_pre", "grad.layers.1.attn.k.weight"},
  };
  for (const auto& m : mutants) {
    for (const auto& rep : expect_mutant_fails_at_its_stage(m, /*backward=*/true)) {
      EXPECT_EQ(rep.not_checked, 0) << rep.name;
      for (const auto& t : rep.tensors) {
        if (t.name.starts_with("act.")) {
          EXPECT_EQ(t.status, golden::Status::pass) << rep.name << " " << t.name;
        }
      }
    }
  }
}

TEST(GoldenMutants, EachFailsAtTheStageWhereItsBugLives) {
  using M = teo::testing::Mutation;
  const std::vector<Mutant> mutants = {
      {M::no_score_scale, "post_gelu_mean", "layers.0.scores"},
      {M::layer_norm_unbiased, "post_gelu_mean", "layers.0.norm1"},
      {M::layer_norm_unbiased, "pre_gelu_mean", "layers.0.norm1"},
      {M::layer_norm_eps_outside, "large_eps", "layers.0.norm1"},
      {M::pe_sin_cos_swapped, "post_gelu_mean", "positional"},
      {M::pe_frequency_off_by_one, "post_gelu_mean", "positional"},
      {M::mask_ignores_padding, "post_gelu_mean", "layers.0.scores"},
      {M::softmax_wrong_axis, "post_gelu_mean", "layers.0.probs"},
      {M::tanh_gelu_for_exact, "post_gelu_mean", "layers.0.ffn_hidden"},
      {M::transposed_weight, "post_gelu_mean", "layers.0.q"},
      {M::dropout_scale_missing, "dropout_post", "input"},
      {M::label_smoothing_ignored, "label_smoothing", "loss"},
      {M::mean_pool_includes_padding, "post_gelu_mean", "pooled"},
      // the attention variants
      {M::kv_heads_tiled, "gqa_half", "layers.0.scores"},
      {M::rope_other_convention, "rope_interleaved", "layers.0.q_rot"},
      {M::rope_bf16_positions, "rope_yarn_offset", "layers.0.q_rot"},
      {M::window_one_wider, "window_s_minus_1", "layers.0.scores"},
      {M::alibi_sign_flipped, "alibi_causal", "layers.0.scores"},
      {M::softcap_after_mask, "softcap", "layers.0.scores"},
      {M::sink_column_kept, "sinks_masked", "layers.0.probs"},
  };
  for (const auto& m : mutants) expect_mutant_fails_at_its_stage(m, /*backward=*/false);
}

// Each mutant on one case (its full name, forward and backward): it must fail, first at its stage.
void expect_each_fails_on_its_case(const std::vector<Mutant>& mutants) {
  for (const auto& m : mutants) {
    const std::string what =
        std::string(teo::testing::mutation_name(m.mutation)) + " on " + m.case_name;
    const st::File& g = committed(m.case_name);
    const auto rep = golden::check(g, teo::testing::naive_candidate(g, m.mutation), {});
    EXPECT_GT(rep.failed, 0) << what;
    EXPECT_EQ(rep.first_divergence, m.stage) << what;
  }
}

// The decoders' bugs, each on one case (its full name): the forward ones at their activation, the
// tied head's at the embedding's gradient, the last gradient backward writes.
TEST(GoldenMutants, DecoderMutantsFailWhereTheirBugLives) {
  using M = teo::testing::Mutation;
  const std::vector<Mutant> mutants = {
      {M::decoder_not_causal, "llama_block_f64", "layers.0.scores"},
      {M::decoder_not_causal, "gpt2_post_tied_f32", "layers.0.scores"},
      {M::labels_not_shifted, "llama_block_f32", "loss"},
      {M::labels_not_shifted, "gpt2_pre_tied_f64", "loss"},
      {M::tied_head_grad_dropped, "gpt2_pre_tied_f64", "grad.embedding.weight"},
      {M::tied_head_grad_dropped, "fp16_gpt2_tied", "grad.embedding.weight"},
      // the prompt's forward passes; the first step's token sits one position too far
      {M::generation_position_off_by_one, "generate_gpt2_f64", "generate.0.logits"},
      {M::generation_position_off_by_one, "generate_llama_f32", "generate.0.logits"},
  };
  expect_each_fails_on_its_case(mutants);
}

// BERT's embeddings and pooler, ViT's patches (semantics 18): each bug at the first activation it
// changes.
TEST(GoldenMutants, RealEncoderMutantsFailWhereTheirBugLives) {
  using M = teo::testing::Mutation;
  expect_each_fails_on_its_case({
      {M::token_types_ignored, "bert_f64", "embedding_norm"},
      {M::token_types_ignored, "bert_rms_pre_types3_f64", "embedding_norm"},
      // the dropout must act after the norm: only a case with dropout tells the two orders apart
      {M::embedding_norm_after_dropout, "bert_dropout_f64", "embedding_norm"},
      {M::pooler_without_tanh, "bert_f64", "pooler"},
      {M::pooler_without_tanh, "bert_f32", "pooler"},
      {M::patches_hwc_flattened, "vit_f64", "embedding"},
      {M::patches_hwc_flattened, "vit_f32", "embedding"},
      {M::cls_token_appended, "vit_f64", "embedding"},
  });
}

}  // namespace
