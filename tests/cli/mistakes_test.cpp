// A newcomer's mistakes, each named: a misspelled tensor, file, flag, command, op, config or spec
// key, a shape or dtype that does not fit, a file that is not safetensors. None passes silently.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include "cli/run_cli.hpp"
#include "support.hpp"

#include "teo/files.hpp"
#include "teo/safetensors.hpp"
#include "teo/suggest.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;

using teo::test::CliResult;
using teo::test::run_cli;
using teo::test::slurp;

const fs::path kCorpus = fs::path(TEO_SOURCE_DIR) / "golden";
const std::string kGolden = (kCorpus / "causal_post_f64.safetensors").string();

using teo::test::fresh_dir;

// The golden's act.* tensors, edited by `edit`, written to `path`: a candidate.
template <class Edit>
std::string candidate(const fs::path& path, Edit&& edit) {
  const st::File g = st::read(kGolden);
  st::File c;
  for (const auto& t : g.tensors)
    if (t.name.starts_with("act.")) c.tensors.push_back(t);
  edit(c);
  teo::write_file_atomic(path.string(), st::serialize(c), true);
  return path.string();
}

st::Tensor* tensor(st::File& f, const std::string& name) {
  for (auto& t : f.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

TEST(Suggest, FindsTheMisspelledNameAndNothingFarAway) {
  EXPECT_EQ(teo::edit_distance("candidte", "candidate"), 1u);
  EXPECT_EQ(teo::edit_distance("outptu", "output"), 1u) << "a transposition is one edit";
  EXPECT_EQ(teo::edit_distance("", "abc"), 3u);
  const std::vector<std::string> names = {"act.layers.0.output", "act.layers.1.output",
                                          "act.logits"};
  EXPECT_EQ(teo::closest_match("act.layer.0.output", names), "act.layers.0.output");
  EXPECT_EQ(teo::closest_match("act.layers.1.outptu", names), "act.layers.1.output");
  EXPECT_EQ(teo::closest_match("grad.head.weight", names), "");
  EXPECT_EQ(teo::closest_match("head_dim", {"batch", "d_head", "seq_len"}), "d_head")
      << "the same words, abbreviated and reordered";
  EXPECT_EQ(teo::closest_match("act.logits", names), "") << "never the word itself";
  EXPECT_EQ(teo::did_you_mean("goldn", {"golden", "train"}), "; did you mean \"golden\"?");
  EXPECT_EQ(teo::did_you_mean("xyzzy", {"golden", "train"}), "");
  // nothing is a typo of a word as short as the edits it takes
  EXPECT_EQ(teo::closest_match("-v", {"-h", "--help"}), "");
  EXPECT_EQ(teo::closest_match("p", {"op", "dropout", "seed"}), "");
  EXPECT_EQ(teo::closest_match("layer.safetensors", {"model.safetensors"}), "");
  EXPECT_EQ(teo::closest_match("one_layr_f64.safetensors", {"one_layer_f64.safetensors"}),
            "one_layer_f64.safetensors");
  EXPECT_EQ(teo::closest_match("--candidte", {"--golden", "--candidate"}), "--candidate");
}

// The typo candidate: act.layers.0.output, doubled, under a misspelled name. It must fail, be
// named in every report format with the right name suggested, and pass only with --allow-extra.
TEST(Mistakes, AMisspelledCandidateTensorFailsWithASuggestionInEveryReport) {
  const fs::path dir = fresh_dir("teo_mistakes_typo");
  const std::string cand = candidate(dir / "typo.safetensors", [](st::File& c) {
    st::Tensor* t = tensor(c, "act.layers.0.output");
    auto v = t->float_values();
    for (auto& x : v) x *= 2;
    std::memcpy(t->bytes.data(), v.data(), v.size() * sizeof(double));
    t->name = "act.layer.0.output";
  });
  const std::string json = (dir / "r.json").string(), junit = (dir / "r.xml").string();
  CliResult r = run_cli("golden check --golden " + kGolden + " --candidate " + cand + " --json " +
                        json + " --junit " + junit + " --no-progress");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("act.layer.0.output"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did you mean \"act.layers.0.output\"?"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("first divergence"), std::string::npos)
      << "a stray name is not a divergence of the pipeline: " << r.out;
  const auto j = nlohmann::json::parse(slurp(json));
  const auto& c = j.at("cases").at(0);
  EXPECT_EQ(c.at("unknown"), 1);
  bool found = false;
  for (const auto& t : c.at("tensors")) {
    if (t.at("name") != "act.layer.0.output") continue;
    found = true;
    EXPECT_EQ(t.at("status"), "fail");
    EXPECT_TRUE(t.at("ratio").is_null()) << "nothing was compared: no ratio of 0";
    EXPECT_NE(t.at("message").get<std::string>().find("act.layers.0.output"), std::string::npos);
  }
  EXPECT_TRUE(found) << j.dump(2);
  const std::string xml = slurp(junit);
  EXPECT_NE(xml.find("name=\"act.layer.0.output\"><failure"), std::string::npos) << xml;

  r = run_cli("golden check --allow-extra --golden " + kGolden + " --candidate " + cand +
              " --no-progress");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("accepted by --allow-extra: act.layer.0.output"), std::string::npos)
      << r.out;
  // the summary leads with what was not checked
  EXPECT_NE(r.out.find("summary: 41 of 72 not checked (not in the candidate); 31 passed"),
            std::string::npos)
      << r.out;
}

// --hide-unchecked leaves out the rows of tensors the candidate does not hold: a whole-model
// candidate of 7 tensors prints 7 rows, not 72.
TEST(Mistakes, HideUncheckedPrintsOnlyTheCheckedRows) {
  const fs::path dir = fresh_dir("teo_mistakes_hide");
  const std::string cand = candidate(dir / "seven.safetensors", [](st::File& c) {
    std::erase_if(c.tensors, [](const st::Tensor& t) {
      return !(t.name.ends_with(".output") || t.name == "act.logits" || t.name == "act.loss" ||
               t.name == "act.pooled" || t.name == "act.input" || t.name == "act.layers.0.probs");
    });
  });
  ASSERT_EQ(st::read(cand).tensors.size(), 7u);
  const auto rows = [](const std::string& out) {
    std::size_t n = 0;
    for (std::size_t at = out.find("  pass"); at != std::string::npos;
         at = out.find("  pass", at + 1))
      ++n;
    for (std::size_t at = out.find("  not checked"); at != std::string::npos;
         at = out.find("  not checked", at + 1))
      ++n;
    return n;
  };
  CliResult all = run_cli("golden check --golden " + kGolden + " --candidate " + cand);
  CliResult some =
      run_cli("golden check --hide-unchecked --golden " + kGolden + " --candidate " + cand);
  EXPECT_EQ(all.code, 0) << all.out;
  EXPECT_EQ(some.code, 0) << some.out;
  EXPECT_EQ(rows(all.out), 72u) << all.out;
  EXPECT_EQ(rows(some.out), 7u) << some.out;
  EXPECT_NE(some.out.find("(65 rows of tensors not checked hidden)"), std::string::npos)
      << some.out;
}

// Directory mode names a candidate file with no golden of its name (and fails on it unless
// --allow-extra), and the goldens with no candidate file.
TEST(Mistakes, DirectoryModeNamesFilesWithoutAPartner) {
  const fs::path dir = fresh_dir("teo_mistakes_dirs");
  fs::create_directories(dir / "golden");
  fs::create_directories(dir / "cand");
  for (const char* n : {"causal_post_f64.safetensors", "one_layer_f64.safetensors"})
    fs::copy_file(kCorpus / n, dir / "golden" / n);
  fs::copy_file(kCorpus / "causal_post_f64.safetensors",
                dir / "cand" / "causal_post_f64.safetensors");
  fs::copy_file(kCorpus / "one_layer_f64.safetensors", dir / "cand" / "one_layr_f64.safetensors");
  const std::string args = "golden check --golden " + (dir / "golden").string() + " --candidate " +
                           (dir / "cand").string();
  CliResult r = run_cli(args);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("one_layr_f64.safetensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did you mean one_layer_f64.safetensors?"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("candidate files with no golden (1):"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("goldens with no candidate file (1):"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("with no golden of their name: " +
                       (dir / "cand" / "one_layr_f64.safetensors").string()),
            std::string::npos)
      << r.out;
  r = run_cli(args + " --allow-extra");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(accepted by --allow-extra)"), std::string::npos) << r.out;

  // a candidate directory whose only file matches no golden names it
  fs::remove(dir / "cand" / "causal_post_f64.safetensors");
  r = run_cli(args + " --allow-extra");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("nothing was checked: no golden has a candidate file of its name"),
            std::string::npos)
      << r.out;
  // and one candidate file of the right name holding none of the golden's tensors names the file
  const std::string odd = candidate(dir / "odd.safetensors", [](st::File& c) {
    for (auto& t : c.tensors) t.name = "mine." + t.name;
  });
  r = run_cli("golden check --allow-extra --golden " + kGolden + " --candidate " + odd);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("nothing was checked: the candidate " + odd + " holds none"),
            std::string::npos)
      << r.out;
}

// An optional output the case's spec turned off (scores and probs of a row-blocked case) is the
// op's own name, not a misspelling: listed as not in the golden, never failed.
TEST(Mistakes, AnOptionalOutputTheCaseDoesNotHoldIsNotAMisspelling) {
  const fs::path dir = fresh_dir("teo_mistakes_optional");
  const std::string g = (kCorpus / "ops" / "attention_rows_f64.safetensors").string();
  const st::File golden = st::read(g);
  st::File c;
  for (const auto& t : golden.tensors)
    if (t.name == "output.context") c.tensors.push_back(t);
  st::Tensor scores = c.tensors.front();
  scores.name = "output.scores";
  c.tensors.push_back(scores);
  st::Tensor typo = c.tensors.front();
  typo.name = "output.contxt";
  const std::string ok = (dir / "ok.safetensors").string();
  teo::write_file_atomic(ok, st::serialize(c), true);
  CliResult r = run_cli("golden check --golden " + g + " --candidate " + ok);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("not in golden"), std::string::npos) << r.out;
  c.tensors.push_back(typo);
  const std::string bad = (dir / "bad.safetensors").string();
  teo::write_file_atomic(bad, st::serialize(c), true);
  r = run_cli("golden check --only backward --golden " + g + " --candidate " + bad);
  EXPECT_EQ(r.code, 1) << "--only does not hide a misspelled name\n" << r.out;
  EXPECT_NE(r.out.find("did you mean \"output.context\"?"), std::string::npos) << r.out;
}

struct Mistake {
  std::string what;
  std::string args;
  std::string expected;  // in the output
  int code = 2;
};

// Each mistake of a newcomer's first hour, with the message that names it.
TEST(Mistakes, EachIsNamedWithTheFix) {
  const fs::path dir = fresh_dir("teo_mistakes_table");
  const std::string spec = (dir / "attn.json").string();
  teo::write_file_atomic(spec,
                         R"({"batch": 1, "num_heads": 1, "seq_len": 2, "head_dim": 4,)"
                         R"( "dtype": "float64", "seed": 1})",
                         true);
  const std::string spec2 = (dir / "attn2.json").string();
  teo::write_file_atomic(spec2,
                         R"({"batch": 1, "num_heads": 1, "seq_len": 2, "d_head": 4,)"
                         R"( "casual": true, "dtype": "float64", "seed": 1})",
                         true);
  const std::string config = (dir / "config.json").string();
  teo::write_file_atomic(config, R"({"d_modle": 8})", true);
  const std::string npz = (dir / "cand.npz").string();
  teo::write_file_atomic(npz, std::string("PK\x03\x04", 4) + std::string(60, '\0'), true);
  const std::string narrow = candidate(dir / "narrow.safetensors", [](st::File& c) {
    st::Tensor* t = tensor(c, "act.layers.1.probs");
    t->shape.back() -= 1;
    t->bytes.resize(t->bytes.size() / 9 * 8);
  });
  const std::string f32 = candidate(dir / "f32.safetensors", [](st::File& c) {
    st::Tensor* t = tensor(c, "act.logits");
    const auto v = t->float_values();
    std::vector<float> f(v.begin(), v.end());
    t->dtype = st::DType::F32;
    t->bytes.assign(reinterpret_cast<const unsigned char*>(f.data()),
                    reinterpret_cast<const unsigned char*>(f.data() + f.size()));
  });
  const std::string check = "golden check --no-progress --golden " + kGolden + " --candidate ";
  const std::vector<Mistake> mistakes = {
      {"a misspelled flag", check.substr(0, check.find("--candidate")) + "--candidte x",
       "unknown flag --candidte for `teo golden check`; did you mean \"--candidate\"?"},
      {"a misspelled command", "goldn list",
       "unknown command \"goldn\" for `teo`; did you mean \"golden\"?"},
      {"a misspelled subcommand", "golden chek --golden x",
       "unknown command \"chek\" for `teo golden`; did you mean \"check\"?"},
      {"a misspelled op", "golden op --op atention --spec " + spec + " --out /dev/null",
       "teo: error: unknown op \"atention\"; did you mean \"attention\"? (the ops are linear,"},
      {"a spec key under another name", "golden op --op attention --spec " + spec + " --out x",
       "the spec needs \"d_head\" (it has \"head_dim\": is that it?)"},
      {"a misspelled spec key", "golden op --op attention --spec " + spec2 + " --out x",
       "the spec has the unknown key \"casual\"; did you mean \"causal\"?"},
      {"a misspelled config key", "shapes --config " + config,
       "unknown config key \"d_modle\"; did you mean \"d_model\"?"},
      {"a file that is not safetensors", check + npz,
       "not a safetensors file: it is a zip archive (numpy's .npz"},
      {"a shape that does not fit", check + narrow,
       "act.layers.1.probs                          shape mismatch: candidate [3, 3, 9, 8], golden "
       "[3, 3, 9, 9]  FAIL",
       1},
      {"a float32 candidate of a float64 golden", check + f32,
       "dtype mismatch: candidate F32, golden F64; a float32 candidate is judged against a "
       "float64 golden with --precision fp32",
       1},
      {"a flag of every command: golden list", "golden list --threads 2 --golden " + kGolden,
       "causal_post_f64.safetensors  model", 0},
      {"golden list shows what a model case reads", "golden list --golden " + kGolden,
       "  reads  param.layers.0.attn.q.weight", 0},
      {"golden list shows a model case's config", "golden list --golden " + kGolden,
       "  config {\"activation\":", 0},
      {"train's help gives its own default backend", "train --help",
       "(default: TEO_BACKEND, else simd)", 0},
      {"check's help gives its own default backend", "golden check --help",
       "(default: TEO_BACKEND, else reference)", 0},
  };
  for (const auto& m : mistakes) {
    const CliResult r = run_cli(m.args);
    EXPECT_EQ(r.code, m.code) << m.what << ": teo " << m.args << "\n" << r.out;
    EXPECT_NE(r.out.find(m.expected), std::string::npos)
        << m.what << ": teo " << m.args << "\nexpected: " << m.expected << "\ngot: " << r.out;
  }
}

}  // namespace
