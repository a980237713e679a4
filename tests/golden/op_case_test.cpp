// Op cases: the committed op corpus is reproduced bit for bit and covers its edge cases; every
// op's backward agrees with central finite differences taken through the op-case path itself;
// the row-blocked attention gives the materialised path's bits; specs fail with named errors
// before anything is allocated; and the checker judges op files by the model cases' rules.
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "check_support.hpp"
#include "golden/ops/op.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/layers/attention.hpp"
#include "teo/model.hpp"
#include "teo/rng.hpp"
#include "teo/sha256.hpp"
#include "teo/tensor.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
namespace golden = teo::golden;
using nlohmann::json;
using teo::index_t;
using teo::golden::test_support::find_mut;

const fs::path kOps = fs::path(TEO_SOURCE_DIR) / "golden" / "ops";

using teo::test::slurp;

const std::vector<golden::OpCorpusEntry>& op_corpus() {
  static const auto entries = golden::read_op_corpus_cases((kOps / "cases.json").string());
  return entries;
}

golden::OpCase spec(const std::string& op, json j) {
  j["op"] = op;
  if (!j.contains("dtype")) j["dtype"] = "float64";
  if (!j.contains("seed")) j["seed"] = 11;
  return golden::OpCase::from_json(j);
}

// ---- the op corpus -----------------------------------------------------------------------------

TEST(OpCorpus, ManifestMatchesAndRegeneratesBitForBitOnOneAndTwoThreads) {
  const json m = json::parse(slurp(kOps / "manifest.json"));
  ASSERT_EQ(m["files"].size(), op_corpus().size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < op_corpus().size(); ++i) {
    const auto& f = m["files"][i];
    EXPECT_EQ(f["file"], op_corpus()[i].name + ".safetensors");
    const std::string bytes = slurp(kOps / f["file"].get<std::string>());
    EXPECT_EQ(f["sha256"], teo::sha256_hex(bytes)) << f["file"] << ": the committed file";
    EXPECT_EQ(f["bytes"], bytes.size()) << f["file"];
    EXPECT_FALSE(f["description"].get<std::string>().empty());
    total += bytes.size();
  }
  EXPECT_EQ(m["total_bytes"], total);
  for (int threads : {1, 2}) {
    teo::ScopedSettings keep;
    teo::set_num_threads(threads);
    for (std::size_t i = 0; i < op_corpus().size(); ++i) {
      const auto& e = op_corpus()[i];
      const std::string bytes = st::serialize(golden::make_op(e.spec));
      EXPECT_EQ(m["files"][i]["sha256"], teo::sha256_hex(bytes))
          << e.name << " differs from the committed file with " << threads << " thread(s)";
    }
  }
}

// write_op streams a case to its file as it is computed (the at-scale cases are too large to be
// held whole): every committed case comes out with the committed bytes, an existing file is
// refused and left as it was, and a case that cannot be written leaves nothing behind.
TEST(OpCorpus, WrittenAsComputedEveryCaseHasTheCommittedBytes) {
  const fs::path dir = teo::test::fresh_dir("teo_write_op");
  for (const auto& e : op_corpus()) {
    const fs::path out = dir / (e.name + ".safetensors");
    const std::uint64_t size = golden::write_op(e.spec, out.string(), /*overwrite=*/false);
    const std::string bytes = slurp(out);
    EXPECT_EQ(size, bytes.size()) << e.name;
    EXPECT_TRUE(bytes == slurp(kOps / (e.name + ".safetensors"))) << e.name;
  }
  const auto& first = op_corpus().front();
  const fs::path taken = dir / (first.name + ".safetensors");
  std::ofstream(taken, std::ios::binary | std::ios::trunc) << "mine";
  EXPECT_THROW(golden::write_op(first.spec, taken.string(), false), teo::FileError);
  EXPECT_EQ(slurp(taken), "mine");
  // with --keep the case is built in memory, kept, then written
  const fs::path kept = dir / "kept.safetensors";
  golden::write_op(first.spec, kept.string(), false, false, "output.*");
  EXPECT_TRUE(slurp(kept) == st::serialize(golden::make_op(first.spec, false, "output.*")));
  EXPECT_THROW(golden::write_op(first.spec, (dir / "no" / "such.safetensors").string(), false),
               teo::FileError);
  EXPECT_FALSE(fs::exists(dir / "no"));
  // small enough to be written as it is computed, too large to be held whole: make_op refuses
  // it by name before allocating anything
  const auto big = spec("linear", {{"rows", 1}, {"in_features", 300'000'000}, {"out_features", 1}});
  EXPECT_LE(big.bytes_needed(), std::uint64_t{1} << 34);
  teo::test::expect_throw<teo::ShapeError>([&] { (void)golden::make_op(big); }, "built in memory");
  for (const auto& p : fs::directory_iterator(dir)) {
    EXPECT_EQ(p.path().filename().string().find(".tmp-"), std::string::npos)
        << p.path() << " left behind";
  }
  fs::remove_all(dir);
}

TEST(OpCorpus, CoversEveryOpDtypePrecisionAndEdgeCase) {
  std::set<std::string> ops, dtypes, precisions;
  bool len0 = false, len1 = false, s1 = false, dh1 = false, odd_dh = false, one_head = false,
       masked_row = false, c1 = false, c2 = false, rows_path = false, odd_rows = false,
       empty_in_layer = false;
  bool decode = false, chunk = false, top_left = false, mla = false, head256 = false, gqa8 = false;
  bool kv_len0 = false, kv_len1 = false, kv_boundary = false, kv_chunk = false, kv_unused = false,
       kv_gqa8 = false, kv_mqa = false, kv_head256 = false, kv_mla = false, merge_empty = false;
  std::set<int> page_sizes, merge_parts;
  std::set<std::string> orders, kv_precisions, ffn_kinds;
  bool ffn_no_bias = false;
  for (const auto& e : op_corpus()) {
    const auto& s = e.spec.spec;
    ops.insert(e.spec.op);
    dtypes.insert(e.spec.dtype);
    if (e.spec.precision) precisions.insert(teo::to_string(*e.spec.precision));
    for (const char* key : {"lengths", "visible"}) {
      if (!s.contains(key)) continue;
      for (const auto& l : s[key]) {
        len0 |= l == 0;
        len1 |= l == 1;
        masked_row |= std::string(key) == "visible" && l == 0;
        empty_in_layer |= e.spec.op == "encoder_layer" && l == 0;
      }
    }
    if (e.spec.op == "attention") {
      s1 |= s.value("seq_len", 0) == 1;
      // inference attention: decode, chunked prefill, both alignments, MLA, head 256, GQA 8
      const int sq = s.value("q_len", 0), skv = s.value("kv_len", 0);
      decode |= sq == 1 && skv > 1;
      chunk |= sq > 1 && skv > sq;
      top_left |= s.value("causal_align", "") == "top_left";
      mla |= s.value("d_head_v", 0) == 128 && s["d_head"] == 192;
      head256 |= s["d_head"] == 256;
      gqa8 |= s["num_heads"].get<int>() == 8 * s.value("num_kv_heads", s["num_heads"].get<int>());
      dh1 |= s["d_head"] == 1;
      odd_dh |= s["d_head"].get<int>() % 2 == 1 && s["d_head"].get<int>() > 1;
      one_head |= s["num_heads"] == 1;
      rows_path |= s["probs"] == false;
    }
    if (e.spec.op == "attention_kvcache") {
      // serving steps: the cache's edges, the page sizes and orders, the head shapes
      const int sq = s["q_len"], ps = s.value("page_size", 0);
      const int h = s["num_heads"], hkv = s.value("num_kv_heads", h);
      int most = 0;
      for (const auto& c : s["cache_lengths"]) {
        kv_len0 |= sq == 1 && c == 0;
        kv_len1 |= sq == 1 && c == 1;
        kv_boundary |= ps > 0 && (c.get<int>() + sq) % ps == 0;
        kv_chunk |= sq == 7 && c == 50;
        most = std::max(most, ps > 0 ? (c.get<int>() + sq + ps - 1) / ps : 0);
      }
      if (ps > 0) page_sizes.insert(ps);
      if (s.contains("page_order")) orders.insert(s["page_order"].get<std::string>());
      if (s.contains("block_table")) orders.insert("explicit");
      kv_unused |= s.value("max_pages", 0) > most || s.contains("block_table");
      kv_gqa8 |= h == 8 * hkv;
      kv_mqa |= hkv == 1 && h > 1;
      kv_head256 |= s["d_head"] == 256;
      kv_mla |= s["d_head"] == 192 && s.value("d_head_v", 0) == 128;
      if (e.spec.precision) kv_precisions.insert(teo::to_string(*e.spec.precision));
    }
    if (e.spec.op == "attention_merge") {
      merge_parts.insert(s["num_parts"].get<int>());
      merge_empty |= !s["empty_parts"].empty() && s["empty_parts"].size() < s["num_parts"];
    }
    if (e.spec.op == "ffn") {
      ffn_kinds.insert(s.value("ffn", "mlp"));
      ffn_no_bias |= !s.value("ffn_bias", true);
    }
    if (e.spec.op == "cross_entropy") {
      c1 |= s["num_classes"] == 1;
      c2 |= s["num_classes"] == 2;
    }
    if (s.contains("rows")) odd_rows |= s["rows"].get<int>() % 2 == 1 && s["rows"].get<int>() > 8;
  }
  EXPECT_EQ(ops.size(), golden::op_names().size());
  EXPECT_EQ(dtypes, (std::set<std::string>{"float32", "float64"}));
  EXPECT_EQ(precisions, (std::set<std::string>{"bf16", "fp16", "fp8", "tf32"}));
  for (auto [what, seen] : {std::pair{"length 0", len0},
                            {"length 1", len1},
                            {"S = 1", s1},
                            {"Dh = 1", dh1},
                            {"odd Dh", odd_dh},
                            {"one head", one_head},
                            {"a fully masked softmax row", masked_row},
                            {"C = 1", c1},
                            {"C = 2", c2},
                            {"the row-blocked attention", rows_path},
                            {"decode (one query, many keys)", decode},
                            {"chunked prefill", chunk},
                            {"top-left alignment", top_left},
                            {"MLA head sizes (192, 128)", mla},
                            {"head size 256", head256},
                            {"GQA ratio 8", gqa8},
                            {"decode on an empty cache", kv_len0},
                            {"decode on a cache of 1", kv_len1},
                            {"an append ending on a page boundary", kv_boundary},
                            {"chunked prefill of 7 on a cache of 50", kv_chunk},
                            {"a block table with unused entries", kv_unused},
                            {"GQA 8 on a cache", kv_gqa8},
                            {"MQA on a cache", kv_mqa},
                            {"head size 256 on a cache", kv_head256},
                            {"MLA (192, 128) on a cache", kv_mla},
                            {"a merge with an empty split", merge_empty},
                            {"an empty sequence in a layer", empty_in_layer},
                            {"N off every register tile", odd_rows},
                            {"an FFN without biases", ffn_no_bias}}) {
    EXPECT_TRUE(seen) << "no op case has " << what;
  }
  for (int ps : {1, 16, 128, 256}) EXPECT_TRUE(page_sizes.contains(ps)) << "page size " << ps;
  EXPECT_EQ(orders, (std::set<std::string>{"explicit", "in_order", "reversed", "shuffled"}));
  for (const char* p : {"bf16", "fp16"}) EXPECT_TRUE(kv_precisions.contains(p)) << p << " cache";
  for (int n : {1, 3}) EXPECT_TRUE(merge_parts.contains(n)) << "a merge of " << n << " parts";
  EXPECT_EQ(ffn_kinds, (std::set<std::string>{"geglu", "mlp", "swiglu"}));
}

TEST(OpCorpus, EveryCasePassesAgainstItselfAndItsEmulatedRuns) {
  for (const auto& e : op_corpus()) {
    const st::File f = st::read((kOps / (e.name + ".safetensors")).string());
    // a precision case's stored outputs are a float32 run's: judged as one (by default a
    // precision case is judged in its precision, below)
    golden::CheckOptions plain;
    if (e.spec.precision)
      plain.precision = e.spec.dtype == "float32" ? teo::Precision::fp32 : teo::Precision::fp64;
    const auto rep = golden::check(f, f, plain);
    EXPECT_EQ(rep.failed, 0) << e.name;
    EXPECT_GT(rep.passed, 0) << e.name;
    if (e.spec.precision) {
      const auto by_default = golden::check(f, f, {});
      EXPECT_EQ(by_default.precision, teo::to_string(*e.spec.precision)) << e.name;
      golden::CheckOptions o;
      o.precision = *e.spec.precision;
      if (o.precision == teo::Precision::fp8) {
        // The case's own outputs are float32's, not its recipe's: in a linear case, where the
        // recipe rule decides (docs/fp8.md, "Judging"), they fail it, and pass the budget alone.
        const auto off = golden::check(f, f, o);
        EXPECT_EQ(off.recipe_rule, e.spec.spec["op"] == "linear") << e.name;
        if (off.recipe_rule) {
          EXPECT_GT(off.failed, 0) << e.name;
          EXPECT_NE(off.first_divergence, "") << e.name;
        }
        o.fp8_recipe_k = std::numeric_limits<double>::infinity();
      }
      const auto low = golden::check(f, f, o);
      EXPECT_EQ(low.failed, 0) << e.name;
      // without the recipe rule an fp8 tensor whose emulated error is above bf16's 0.1 of its
      // scale is vacuous (docs/fp8.md, "Judging"): gradients through two or three fp8 products
      if (o.precision == teo::Precision::fp8)
        EXPECT_LE(low.vacuous, low.passed) << e.name;
      else
        EXPECT_EQ(low.vacuous, 0) << e.name;
      EXPECT_TRUE(low.budget) << e.name;
    }
  }
}

// ---- finite differences through the op-case path ----------------------------------------------

// sum over the case's outputs of grad.output.<o> * <o>, from run_op on `f`.
double objective(const st::File& f) {
  const auto r = golden::run_op(f);
  double sum = 0;
  for (const auto& [name, vals] : r) {
    if (!name.starts_with("output.")) continue;
    const auto* up = f.find("grad." + name);
    if (!up) continue;  // an optional output: no gradient flows into it
    const auto g = up->float_values();
    // an output that is -inf for every nearby input (the lse of a row with nothing to sum)
    // has no derivative to check
    for (std::size_t i = 0; i < vals.size(); ++i)
      if (std::isfinite(vals[i])) sum += g[i] * vals[i];
  }
  return sum;
}

void set_values(st::Tensor& t, const std::vector<double>& v) {
  ASSERT_EQ(t.dtype, st::DType::F64);
  std::memcpy(t.bytes.data(), v.data(), v.size() * sizeof(double));
}

// For each differentiable input x with gradient g = grad.<x>: the central difference of the
// objective along a random direction d (finite entries of x only), with step h = 1e-5 times x's
// scale, against <g, d>. Central differences err by O(h^2 |f'''|) plus O(eps |f| / h); with
// these sizes both are below 1e-7 of the derivative's scale, and 1e-6 leaves room.
void expect_backward_matches_fd(const golden::OpCase& c) {
  SCOPED_TRACE(c.spec.dump());
  const st::File base = golden::make_op(c);
  // A router's choice is piecewise constant: the differences are taken away from its edges, with
  // every token's selection margin far above what the step moves a score (h times the inputs'
  // and weights' scale, at most 1e-4 here). A tie case sits on an edge by construction.
  if (c.spec.value("ties", false)) return;
  if (const auto* m = base.find("output.selection_margin")) {
    for (double v : m->float_values()) ASSERT_GT(v, 1e-3) << "a sample's token near an edge";
  }
  const auto grads = golden::run_op(base);
  int checked = 0;
  for (const auto& [gname, g] : grads) {
    if (!gname.starts_with("grad.input.") && !gname.starts_with("grad.param.")) continue;
    const std::string xname = gname.substr(5);
    const auto* xt = base.find(xname);
    ASSERT_NE(xt, nullptr) << xname;
    const auto x = xt->float_values();
    double scale = 0, gscale = 0, dot = 0;
    for (double v : x)
      if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
    std::vector<double> d(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      d[i] =
          std::isfinite(x[i]) ? 2 * teo::rng::uniform01(7, teo::rng::stream_id(xname), i) - 1 : 0.0;
      dot += g[i] * d[i];
      gscale += std::abs(g[i] * d[i]);
    }
    const double h = 1e-5 * std::max(scale, 1.0);
    double f[2];
    for (int s = 0; s < 2; ++s) {
      st::File p = base;
      std::vector<double> xp = x;
      for (std::size_t i = 0; i < x.size(); ++i) xp[i] += (s == 0 ? h : -h) * d[i];
      for (auto& t : p.tensors)
        if (t.name == xname) set_values(t, xp);
      f[s] = objective(p);
    }
    const double fd = (f[0] - f[1]) / (2 * h);
    EXPECT_NEAR(fd, dot, 1e-6 * std::max(gscale, 1e-3)) << gname;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// Every op of the registry, through each of its samples: no op can be left out.
TEST(OpCases, EveryOpsBackwardMatchesFiniteDifferencesThroughTheOpCasePath) {
  teo::ScopedSettings keep;
  teo::set_backend(teo::Backend::reference);
  ASSERT_EQ(teo::golden::ops::registry().size(), golden::op_names().size());
  for (const auto* def : teo::golden::ops::registry()) {
    ASSERT_FALSE(def->samples.empty()) << def->name << " has no sample spec";
    for (const char* sample : def->samples) {
      const auto c = spec(def->name, json::parse(sample));
      // serving ops, and serving cases of other ops (W8A8's linear)
      if (def->forward_only || teo::golden::ops::spec_of(c).forward_only) {
        // serving ops: outputs only, and no upstream or input gradient in the case
        for (const auto& t : golden::op_contract(c)) EXPECT_TRUE(t.name.starts_with("output."));
        EXPECT_FALSE(golden::run_op(golden::make_op(c)).empty());
        continue;
      }
      expect_backward_matches_fd(c);
    }
  }
}

// Every op's samples with a key removed, an unknown key or a negative size: a named error or a
// valid case (an optional key), never a crash; and the sample itself normalises to a spec that
// reads back to itself.
TEST(OpCases, EveryOpRefusesBrokenSamplesByName) {
  for (const auto* def : teo::golden::ops::registry()) {
    for (const char* sample : def->samples) {
      const json good = json::parse(sample);
      const auto c = spec(def->name, good);
      EXPECT_EQ(golden::OpCase::from_json(json(c.spec)).spec, c.spec) << def->name;
      json unknown = good;
      unknown["bogus_key"] = 1;
      try {
        spec(def->name, unknown);
        ADD_FAILURE() << def->name << " accepted an unknown key";
      } catch (const teo::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("bogus_key"), std::string::npos) << e.what();
      }
      for (const auto& [key, value] : good.items()) {
        json without = good;
        without.erase(key);
        try {
          spec(def->name, without);  // an optional key: its default is valid
        } catch (const teo::ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find(key), std::string::npos)
              << def->name << ": " << e.what();
        } catch (const teo::ShapeError&) {  // a key the others' sizes depend on
        }
        if (value.is_number_integer()) {
          json negative = good;
          negative[key] = -3;
          EXPECT_THROW(spec(def->name, negative), teo::Error) << def->name << "." << key;
        }
      }
    }
  }
}

// ---- the row-blocked attention -----------------------------------------------------------------

// Attention's context and dq, dk, dv.
template <class Real>
struct AttentionResult {
  std::vector<Real> ctx, dq, dk, dv;
};

// The same attention, forward and backward, on the materialised path ([0]) and on the
// row-blocked path ([1]), from inputs drawn from the library's generator.
template <class Real>
std::array<AttentionResult<Real>, 2> both_paths(index_t B, index_t H, index_t S, index_t Dh,
                                                bool causal, std::vector<std::int64_t> lengths,
                                                std::optional<double> scale, index_t block_rows) {
  const index_t n = B * H * S * Dh, ss = B * H * S * S;
  const auto q = teo::test::uniform_vector<Real>(n, 1, "q");
  const auto k = teo::test::uniform_vector<Real>(n, 1, "k");
  const auto v = teo::test::uniform_vector<Real>(n, 1, "v");
  const auto dc = teo::test::uniform_vector<Real>(n, 1, "dcontext");
  std::array<AttentionResult<Real>, 2> r;
  for (auto& x : r) {
    x.ctx.assign(static_cast<std::size_t>(n), Real(0));
    x.dq = x.dk = x.dv = x.ctx;
  }
  std::vector<Real> sc(ss), pr(ss), dp(ss), ds(ss);
  teo::AttentionArgs<Real> a{.batch = B,
                             .heads = H,
                             .seq_len = S,
                             .d_head = Dh,
                             .lengths = lengths.data(),
                             .causal = causal,
                             .scale = scale,
                             .block_rows = block_rows};
  teo::attention_forward(a, {.context = r[0].ctx.data(),
                             .scores = sc.data(),
                             .probs = pr.data(),
                             .q = q.data(),
                             .k = k.data(),
                             .v = v.data()});
  teo::attention_backward(a, {.dq = r[0].dq.data(),
                              .dk = r[0].dk.data(),
                              .dv = r[0].dv.data(),
                              .dprobs = dp.data(),
                              .dscores = ds.data(),
                              .dcontext = dc.data(),
                              .q = q.data(),
                              .k = k.data(),
                              .v = v.data(),
                              .probs = pr.data()});
  teo::attention_forward_rows(
      a, {.context = r[1].ctx.data(), .q = q.data(), .k = k.data(), .v = v.data()});
  teo::attention_backward_rows(a, {.dq = r[1].dq.data(),
                                   .dk = r[1].dk.data(),
                                   .dv = r[1].dv.data(),
                                   .dcontext = dc.data(),
                                   .q = q.data(),
                                   .k = k.data(),
                                   .v = v.data()});
  return r;
}

template <class Real>
void expect_rows_path_bits(index_t B, index_t H, index_t S, index_t Dh, bool causal,
                           std::vector<std::int64_t> lengths, index_t block_rows) {
  SCOPED_TRACE(testing::Message() << "B " << B << " H " << H << " S " << S << " Dh " << Dh
                                  << " causal " << causal << " block_rows " << block_rows);
  const auto r = both_paths<Real>(B, H, S, Dh, causal, std::move(lengths), 0.4, block_rows);
  const auto same_bits = [](const std::vector<Real>& a, const std::vector<Real>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Real)) == 0;
  };
  EXPECT_TRUE(same_bits(r[0].ctx, r[1].ctx)) << "context";
  EXPECT_TRUE(same_bits(r[0].dq, r[1].dq)) << "dq";
  EXPECT_TRUE(same_bits(r[0].dk, r[1].dk)) << "dk";
  EXPECT_TRUE(same_bits(r[0].dv, r[1].dv)) << "dv";
}

// On the reference and blas backends the blocks change the order of dk's and dv's sums: the
// values agree to rounding.
template <class Real>
void expect_rows_path_close(index_t B, index_t H, index_t S, index_t Dh, index_t block_rows) {
  const auto r = both_paths<Real>(B, H, S, Dh, true, std::vector<std::int64_t>(B, S - 1),
                                  std::nullopt, block_rows);
  // Sums of S terms of order 1: 64 S ulps of 1 bound any reordering.
  const double tol = 64.0 * static_cast<double>(S) * std::numeric_limits<Real>::epsilon();
  for (std::size_t i = 0; i < r[0].ctx.size(); ++i) {
    ASSERT_NEAR(r[0].ctx[i], r[1].ctx[i], tol) << "context " << i;
    ASSERT_NEAR(r[0].dq[i], r[1].dq[i], tol) << "dq " << i;
    ASSERT_NEAR(r[0].dk[i], r[1].dk[i], tol) << "dk " << i;
    ASSERT_NEAR(r[0].dv[i], r[1].dv[i], tol) << "dv " << i;
  }
}

TEST(OpCases, RowBlockedAttentionAgreesOnTheReferenceAndBlasBackends) {
  for (teo::Backend b : {teo::Backend::reference, teo::Backend::blas}) {
    teo::ScopedSettings keep;
    teo::set_backend(b);
    SCOPED_TRACE(teo::to_string(b));
    expect_rows_path_close<double>(2, 2, 29, 5, 4);
    expect_rows_path_close<float>(1, 3, 40, 8, 7);
  }
}

TEST(OpCases, RowBlockedAttentionGivesTheMaterialisedBitsOnEveryIsa) {
  for (teo::Isa isa : teo::supported_isas()) {
    teo::ScopedSettings keep;
    teo::set_backend(teo::Backend::simd);
    teo::set_isa(isa);
    SCOPED_TRACE(teo::to_string(isa));
    for (index_t block : {1, 3, 16, 0}) {
      for (bool causal : {false, true}) {
        expect_rows_path_bits<double>(2, 3, 37, 7, causal, {37, 5}, block);
        expect_rows_path_bits<float>(2, 3, 37, 7, causal, {0, 30}, block);
      }
    }
    expect_rows_path_bits<double>(1, 2, 300, 64, true, {300}, 0);
    expect_rows_path_bits<float>(1, 1, 1, 1, false, {1}, 0);
  }
}

// ---- specs -------------------------------------------------------------------------------------

// OpCase::from_json of spec j (dtype float64 and seed 0 unless j gives them) throws E, whose
// message names `needle`.
template <class E>
void expect_bad_spec(json j, const std::string& needle, const std::string& op = "") {
  if (!j.contains("dtype")) j["dtype"] = "float64";
  if (!j.contains("seed")) j["seed"] = 0;
  SCOPED_TRACE(j.dump());
  teo::test::expect_throw<E>([&] { golden::OpCase::from_json(j, op); }, needle);
}

TEST(OpCases, BadSpecsGiveNamedErrorsBeforeAllocation) {
  using teo::ConfigError;
  using teo::ShapeError;
  const json ok = {{"op", "linear"}, {"rows", 2}, {"in_features", 3}, {"out_features", 4}};
  auto with = [&](const char* key, json v) {
    json j = ok;
    if (v.is_null())
      j.erase(key);
    else
      j[key] = v;
    return j;
  };
  const std::int64_t huge = std::int64_t{1} << 31;
  const json attn = {
      {"op", "attention"}, {"batch", 1}, {"num_heads", 1}, {"seq_len", 4}, {"d_head", 2}};
  auto attn_with = [&](const json& patch) {
    json j = attn;
    j.update(patch);
    return j;
  };
  expect_bad_spec<ConfigError>(with("op", "conv"), "unknown op \"conv\"");
  expect_bad_spec<ConfigError>(with("colour", 1), "unknown key \"colour\"");
  expect_bad_spec<ConfigError>(with("rows", nullptr), "needs \"rows\"");
  expect_bad_spec<ConfigError>(with("rows", -1), "spec.rows");
  expect_bad_spec<ConfigError>(with("rows", 2.5), "spec.rows must be an integer");
  expect_bad_spec<ConfigError>(with("in_features", 0), "spec.in_features");
  expect_bad_spec<ConfigError>(with("dtype", "float16"), "spec.dtype");
  expect_bad_spec<ConfigError>(with("precision", "bf16"), "in a float32 case");
  expect_bad_spec<ConfigError>(with("seed", -3), "spec.seed");
  expect_bad_spec<ConfigError>(ok, "not \"softmax\"", "softmax");
  expect_bad_spec<ShapeError>(with("rows", huge), "MiB");
  expect_bad_spec<ShapeError>(attn_with({{"lengths", {5}}}), "spec.lengths has 5, outside [0, 4]");
  expect_bad_spec<ShapeError>(attn_with({{"batch", 2}, {"lengths", {1}}}),
                              "spec.lengths has 1 entries for 2");
  expect_bad_spec<ConfigError>(attn_with({{"scale", 0}}),
                               "spec.scale must be a number in (0, 1e4]");
  expect_bad_spec<ConfigError>(attn_with({{"scale", 1e300}}),
                               "spec.scale must be a number in (0, 1e4]");
  expect_bad_spec<ConfigError>(
      {{"op", "activation"}, {"rows", 1}, {"cols", 1}, {"activation", "swish"}}, "activation");
  expect_bad_spec<ConfigError>({{"op", "encoder_layer"},
                                {"batch", 1},
                                {"seq_len", 2},
                                {"d_model", 6},
                                {"num_heads", 4},
                                {"d_ff", 3}},
                               "num_heads");
  expect_bad_spec<ConfigError>(
      {{"op", "pooling"}, {"batch", 1}, {"seq_len", 4}, {"d_model", 2}, {"lengths", {"4"}}},
      "spec.lengths must hold integers");
  // Defaulted lengths of an absurd batch are refused by size before they are spelled out.
  expect_bad_spec<ShapeError>({{"op", "softmax"}, {"rows", huge}, {"cols", 1}}, "MiB");
  expect_bad_spec<ShapeError>(attn_with({{"batch", huge}, {"seq_len", 1}}), "MiB");
  // The row-blocked default: a long sequence needs little memory, and its materialised form is
  // refused by size, not attempted.
  json long_attn = attn_with(
      {{"num_heads", 8}, {"seq_len", 16384}, {"d_head", 64}, {"dtype", "float64"}, {"seed", 0}});
  const auto c = golden::OpCase::from_json(long_attn);
  EXPECT_EQ(c.spec["probs"], false);
  EXPECT_LT(c.bytes_needed(), std::uint64_t{4} << 30);
  long_attn["probs"] = true;
  expect_bad_spec<ShapeError>(long_attn, "MiB");
  // The serving ops: the cache's sizes, the block table and the merge's parts, by name, before
  // a page is allocated.
  const json kv = {{"op", "attention_kvcache"},
                   {"batch", 2},
                   {"num_heads", 2},
                   {"q_len", 2},
                   {"d_head", 4},
                   {"layout", "paged"},
                   {"page_size", 4},
                   {"cache_lengths", {5, 1}}};
  auto kv_with = [&](const json& patch) {
    json j = kv;
    j.update(patch);
    return j;
  };
  expect_bad_spec<ConfigError>(kv_with({{"cache_lengths", nullptr}}), "cache_lengths");
  expect_bad_spec<ConfigError>(kv_with({{"layout", "contiguous"}}),
                               "spec.page_size goes with layout \"paged\"");
  expect_bad_spec<ConfigError>(kv_with({{"layout", "pagd"}}), "did you mean \"paged\"");
  expect_bad_spec<ShapeError>(kv_with({{"max_pages", 1}}), "sequence 0 needs 2 pages");
  expect_bad_spec<ShapeError>(kv_with({{"num_pages", 2}}), "fewer than the 3 pages in use");
  expect_bad_spec<ConfigError>(kv_with({{"block_table", {{0, 1}, {1, 0}}}}),
                               "gives page 1 to two entries in use (sequences 0 and 1)");
  expect_bad_spec<ConfigError>(
      kv_with({{"block_table", {{0, 1}, {2, 0}}}, {"page_order", "reversed"}}),
      "page_order and max_pages go without one");
  expect_bad_spec<ShapeError>(kv_with({{"block_table", {{0, 1}, {2, 0}}}, {"num_pages", 2}}),
                              "names page 2, beyond num_pages = 2");
  expect_bad_spec<ShapeError>(kv_with({{"block_table", {{0, 1}}}}), "batch = 2 rows");
  expect_bad_spec<ConfigError>(kv_with({{"block_table", {{0, -1}, {2, 0}}}}),
                               "page indices in [0, 2^31 - 1)");
  expect_bad_spec<ShapeError>(kv_with({{"block_table", {{0, 1}, {2, 0}}}, {"num_pages", huge}}),
                              "MiB");
  expect_bad_spec<ShapeError>(kv_with({{"page_size", huge}}), "MiB");
  json contiguous = kv_with({{"max_len", 6}});
  contiguous.erase("layout");
  contiguous.erase("page_size");
  expect_bad_spec<ShapeError>(
      contiguous, "sequence 0 has 5 cached tokens and q_len = 2 new ones, beyond max_len = 6");
  // no sequences: an empty table, a table with one page, and RoPE over no positions
  for (const json& empty :
       {kv_with({{"batch", 0}, {"cache_lengths", json::array()}, {"block_table", json::array()}}),
        kv_with({{"batch", 0},
                 {"cache_lengths", json::array()},
                 {"q_len", huge},
                 {"positional", "rope"}})}) {
    json j = empty;
    j["dtype"] = "float64";
    j["seed"] = 0;
    const auto c = golden::OpCase::from_json(j, "", std::uint64_t{8} << 20);
    EXPECT_EQ(golden::OpCase::from_json(json(c.spec)).spec, c.spec);
    const st::File f = golden::make_op(c);
    EXPECT_EQ(golden::check(f, f, {}).failed, 0);
  }
  expect_bad_spec<ConfigError>(
      kv_with({{"positional", "rope"}, {"rope_scaling", {{"type", "ntk"}, {"factor", 2.0}}}}),
      "not defined for a KV cache step");
  const json merge = {{"op", "attention_merge"}, {"num_parts", 2}, {"batch", 1},
                      {"num_heads", 1},          {"q_len", 1},     {"d_head_v", 2}};
  json bad_part = merge;
  bad_part["empty_parts"] = {2};
  expect_bad_spec<ConfigError>(bad_part, "part indices in [0, num_parts = 2), got 2");
  bad_part["empty_parts"] = {1, 1};
  expect_bad_spec<ConfigError>(bad_part, "names a part twice");
}

// ---- the checker on op cases -------------------------------------------------------------------

TEST(OpCases, CheckerNamesTheFirstDivergenceAndNeverRequiresOptionalOutputs) {
  const st::File g = golden::make_op(spec("attention", {{"batch", 1},
                                                        {"num_heads", 2},
                                                        {"seq_len", 5},
                                                        {"d_head", 3},
                                                        {"lengths", {4}},
                                                        {"causal", true}}));
  // A fused kernel: context and the input gradients only.
  st::File fused;
  for (const auto& t : g.tensors) {
    if (t.name == "output.context" || t.name.starts_with("grad.input.")) fused.tensors.push_back(t);
  }
  auto rep = golden::check(g, fused, {});
  EXPECT_EQ(rep.failed, 0);
  EXPECT_EQ(rep.not_checked, 0) << "optional outputs are never counted";
  EXPECT_EQ(rep.optional_missing, (std::vector<std::string>{"output.scores", "output.probs"}));
  EXPECT_EQ(json::parse(golden::json_report({rep}))["cases"][0]["optional_missing"],
            json::array({"output.scores", "output.probs"}));
  EXPECT_EQ(rep.passed, 4);
  EXPECT_EQ(golden::verdict({rep}, /*require_all=*/true).exit_code, 0);
  // grad.output.context is an input: a candidate may carry it, and it is never judged.
  for (const auto& t : rep.tensors) EXPECT_FALSE(t.name.starts_with("grad.output.")) << t.name;
  // A wrong dk fails there and nowhere before it.
  st::File bad = fused;
  auto* dk = find_mut(bad, "grad.input.k");
  std::vector<double> v = dk->float_values();
  v[3] += 1e-6;
  set_values(*dk, v);
  rep = golden::check(g, bad, {});
  EXPECT_EQ(rep.failed, 1);
  EXPECT_EQ(rep.first_divergence, "grad.input.k");
  // A missing required gradient is not checked, and --require-all then fails.
  st::File partial;
  partial.tensors.push_back(*fused.find("output.context"));
  rep = golden::check(g, partial, {});
  EXPECT_EQ(rep.not_checked, 3);
  EXPECT_EQ(golden::verdict({rep}, true).exit_code, 1);
  golden::CheckOptions fwd;
  fwd.only = golden::Only::forward;
  rep = golden::check(g, partial, fwd);
  EXPECT_EQ(rep.passed, 1);
  EXPECT_EQ(rep.not_checked, 0);
}

// One layer of the whole model, from the same input, parameters, dropout masks and upstream
// gradient, gives the op's bits, forward and backward.
TEST(OpCases, EncoderLayerCaseIsTheModelsFirstLayerForwardAndBackward) {
  teo::ModelConfig cfg;
  cfg.num_layers = 1;
  cfg.d_model = 8;
  cfg.attention.num_heads = 2;
  cfg.ffn.d_ff = 12;
  cfg.norms.norm_first = true;
  cfg.dropout = 0.2;
  const std::uint64_t seed = 11;  // the op case's seed (spec()), so the layer's masks agree
  const auto params = teo::Params<double>::init(cfg, 5);
  const teo::Batch batch = teo::Batch::random(cfg, 2, 6, 5, {6, 3});
  teo::Activations<double> acts, dacts;
  teo::Params<double> grads;
  teo::forward(params, batch, acts, {.train = true, .dropout_seed = seed});
  teo::backward(params, batch, acts, grads, dacts);
  st::File f = golden::make_op(spec("encoder_layer", {{"batch", 2},
                                                      {"seq_len", 6},
                                                      {"lengths", {6, 3}},
                                                      {"d_model", 8},
                                                      {"num_heads", 2},
                                                      {"d_ff", 12},
                                                      {"norm_first", true},
                                                      {"dropout", 0.2}}));
  set_values(*find_mut(f, "input.x"), {acts.input.begin(), acts.input.end()});
  const auto& dy = dacts.layers[0].output;
  set_values(*find_mut(f, "grad.output.y"), {dy.begin(), dy.end()});
  params.layers[0].visit([&](const std::string& n, const teo::Tensor<double>& t) {
    set_values(*find_mut(f, "param." + n), {t.begin(), t.end()});
  });
  const auto r = golden::run_op(f);
  const auto expect_bits = [&](const std::string& name, const teo::Tensor<double>& want) {
    const auto& got = r.at(name);
    ASSERT_EQ(static_cast<index_t>(got.size()), want.numel()) << name;
    for (index_t i = 0; i < want.numel(); ++i) ASSERT_EQ(got[i], want[i]) << name << " " << i;
  };
  expect_bits("output.y", acts.layers[0].output);
  // The model's input is followed only by the layer, so its gradient is the layer's dx.
  expect_bits("grad.input.x", dacts.input);
  grads.layers[0].visit([&](const std::string& n, const teo::Tensor<double>& g) {
    expect_bits("grad.param." + n, g);
  });
}

}  // namespace
