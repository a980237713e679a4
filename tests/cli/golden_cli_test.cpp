// `teo golden generate` and `teo golden check` end to end: the real binary, files and exit codes.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include "cli/run_cli.hpp"
#include "support.hpp"

#include "teo/files.hpp"
#include "teo/safetensors.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;

using teo::test::CliResult;
using teo::test::run_cli;

using teo::test::slurp;

const fs::path kCorpus = fs::path(TEO_SOURCE_DIR) / "golden";

using teo::test::fresh_dir;

// CASE.json of the committed corpus entry `name`: its config keys and case, without name and
// description; null when there is no such entry.
nlohmann::json corpus_case(const std::string& name) {
  const auto corpus = nlohmann::json::parse(slurp(kCorpus / "cases.json"));
  for (auto c : corpus["cases"]) {
    if (c["name"] != name) continue;
    c.erase("name");
    c.erase("description");
    return c;
  }
  return nullptr;
}

TEST(GoldenCli, GenerateWritesTheCommittedBytesAndRefusesToOverwrite) {
  const fs::path dir = fresh_dir("teo_golden_cli_gen");
  // CASE.json for a corpus entry: its config keys and case, without name and description.
  auto cases = nlohmann::json::parse(slurp(kCorpus / "cases.json"))["cases"];
  nlohmann::json entry = cases[0];
  const std::string name = entry["name"];
  entry.erase("name");
  entry.erase("description");
  std::ofstream(dir / "case.json") << entry.dump();
  const std::string out = (dir / "g.safetensors").string();
  const std::string args =
      "golden generate --config " + (dir / "case.json").string() + " --out " + out;
  CliResult r = run_cli(args);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(slurp(out) == slurp(kCorpus / (name + ".safetensors")));
  std::ofstream(out, std::ios::trunc) << "keep me";
  r = run_cli(args);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("already exists"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(out), "keep me") << "a refused generate changes nothing";
  r = run_cli(args + " --force");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(slurp(out) == slurp(kCorpus / (name + ".safetensors")));
}

// A user's checkpoint: export a golden's parameters and config.json under hf-bert's names,
// generate from them (the case from CASE.json, the model from config.json), export again: the
// two checkpoints are the same bytes, and the new golden's tensors pass against the committed
// one. A checkpoint missing a tensor is a named error that writes nothing.
TEST(GoldenCli, ExportThenGenerateFromTheCheckpointRoundTrips) {
  const fs::path dir = fresh_dir("teo_golden_cli_export");
  const std::string golden = (kCorpus / "bert_f64.safetensors").string();
  const std::string w1 = (dir / "model.safetensors").string(), hf = (dir / "config.json").string();
  CliResult r = run_cli("golden export --names hf-bert --golden " + golden + " --out " + w1 +
                        " --hf-config " + hf);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(slurp(hf)).at("model_type"), "bert");
  // an existing config.json (without --force) stops the export before either file is written
  const std::string w0 = (dir / "first.safetensors").string();
  r = run_cli("golden export --names hf-bert --golden " + golden + " --out " + w0 +
              " --hf-config " + hf);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("already exists"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(w0));
  std::ofstream(dir / "case.json") << nlohmann::json{{"case", corpus_case("bert_f64")["case"]}};
  const std::string again = (dir / "again.safetensors").string();
  r = run_cli("golden generate --no-progress --config " + (dir / "case.json").string() + " --out " +
              again + " --weights " + w1 + " --names hf-bert --hf-config " + hf);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string w2 = (dir / "model2.safetensors").string();
  r = run_cli("golden export --names hf-bert --golden " + again + " --out " + w2);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(slurp(w1) == slurp(w2)) << "the re-exported checkpoint differs";
  r = run_cli("golden check --no-progress --require-all --golden " + golden + " --candidate " +
              again);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(*st::read(again).meta("weights"), "hf-bert: model.safetensors");
  // a checkpoint without one of its tensors
  st::File cut = st::read(w1);
  cut.tensors.erase(cut.tensors.begin() + 3);
  const std::string w3 = (dir / "cut.safetensors").string();
  teo::write_file_atomic(w3, st::serialize(cut), false);
  const std::string out3 = (dir / "never.safetensors").string();
  r = run_cli("golden generate --no-progress --config " + (dir / "case.json").string() + " --out " +
              out3 + " --weights " + w3 + " --names hf-bert --hf-config " + hf);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("has no tensor bert.embeddings.LayerNorm.weight"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(out3));
  // --names without --weights, and an op case to export, are named mistakes
  r = run_cli("golden generate --config " + (dir / "case.json").string() + " --out " + out3 +
              " --names hf-bert");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--weights and --names go together"), std::string::npos) << r.out;
  r = run_cli("golden export --names hf-bert --golden " +
              (kCorpus / "ops" / "linear_f64.safetensors").string() + " --out " + out3);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("is an op case"), std::string::npos) << r.out;
}

// --keep: the globs choose the computed tensors (with their ref64 twins), inputs, parameters and
// masks stay, the metadata records the patterns; a pattern that matches nothing is a named error
// that writes nothing; the full case then checks against the kept file with --require-all, the
// tensors it did not keep reported as "not in golden".
TEST(GoldenCli, GenerateKeepStoresTheMatchingTensorsAndTheCheckSkipsTheRest) {
  const fs::path dir = fresh_dir("teo_golden_cli_keep");
  nlohmann::json entry = corpus_case("dropout_post_f32");
  ASSERT_FALSE(entry.is_null());
  std::ofstream(dir / "case.json") << entry.dump();
  const std::string out = (dir / "kept.safetensors").string();
  CliResult r = run_cli("golden generate --config " + (dir / "case.json").string() + " --out " +
                        out + " --keep 'act.layers.*.output, act.logits,act.loss,grad.head.*'");
  ASSERT_EQ(r.code, 0) << r.out;
  const st::File full = st::read((kCorpus / "dropout_post_f32.safetensors").string());
  const st::File kept = st::read(out);
  ASSERT_NE(kept.meta("kept"), nullptr);
  EXPECT_EQ(*kept.meta("kept"), "act.layers.*.output, act.logits,act.loss,grad.head.*");
  std::vector<std::string> names;
  for (const auto& t : kept.tensors) names.push_back(t.name);
  for (const char* want :
       {"act.layers.0.output", "act.layers.1.output", "act.logits", "act.loss", "grad.head.weight",
        "grad.head.bias", "ref64.act.logits", "ref64.grad.head.bias", "input.tokens",
        "param.embedding.weight", "dropout.layers.0.attn"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  for (const auto& t : kept.tensors) {
    const std::string n = t.name.starts_with("ref64.") ? t.name.substr(6) : t.name;
    if (n.starts_with("act.") || n.starts_with("grad.")) {
      EXPECT_TRUE(n == "act.logits" || n == "act.loss" || n.starts_with("grad.head.") ||
                  (n.starts_with("act.layers.") && n.ends_with(".output")))
          << n;
    }
    // every kept tensor holds the full case's bytes
    EXPECT_TRUE(full.find(t.name) && full.find(t.name)->bytes == t.bytes) << t.name;
  }
  r = run_cli("golden check --golden " + out + " --candidate " +
              (kCorpus / "dropout_post_f32.safetensors").string() + " --require-all");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("not in golden (not kept by --keep"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("6 passed, 0 failed, 0 not checked"), std::string::npos) << r.out;
  const std::string bad = (dir / "bad.safetensors").string();
  r = run_cli("golden generate --config " + (dir / "case.json").string() + " --out " + bad +
              " --keep 'act.logits,act.nothing*'");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("\"act.nothing*\" matches no computed tensor"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(bad));
  r = run_cli("golden generate --config " + (dir / "case.json").string() + " --out " + bad +
              " --keep ' , '");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--keep needs at least one pattern"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(bad));
}

// Generate shows its stages on standard error (plain lines off a terminal; --no-progress none).
// SIGINT during the float32 run stops it at the next stage with exit 130: nothing under --out and
// no temporary file left.
TEST(GoldenCli, GenerateShowsItsStagesAndAnInterruptionLeavesNoFile) {
  const fs::path dir = fresh_dir("teo_golden_cli_interrupt");
  nlohmann::json entry = corpus_case("dropout_post_f32");
  ASSERT_FALSE(entry.is_null());
  std::ofstream(dir / "case.json") << entry.dump();
  const std::string out = (dir / "g.safetensors").string();
  const std::string args =
      "golden generate --config " + (dir / "case.json").string() + " --out " + out + " --force";
  CliResult r = run_cli(args);
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* stage : {"] float32 forward and backward\n", "] writing ",
                            "] float64 reference forward and backward\n", "] conditioning check\n"})
    EXPECT_NE(r.out.find(stage), std::string::npos) << stage << "\n" << r.out;
  r = run_cli(args + " --no-progress");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, "wrote " + out + " (" + std::to_string(fs::file_size(out)) + " bytes)\n");
  fs::remove(out);

  // A case whose float32 run takes a while on the reference backend.
  entry["d_model"] = 128;
  entry["num_heads"] = 4;
  entry["d_ff"] = 512;
  entry["max_len"] = 256;
  entry["case"]["batch"] = 4;
  entry["case"]["seq_len"] = 256;
  entry["case"]["lengths"] = {256, 100, 256, 7};
  std::ofstream(dir / "big.json") << entry.dump();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  const std::string config = (dir / "big.json").string();
  std::vector<std::string> argv_s = {TEO_TEO_BINARY, "golden", "generate",  "--config", config,
                                     "--out",        out,      "--backend", "reference"};
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, TEO_TEO_BINARY, &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  std::string err;
  bool signalled = false;
  std::array<char, 4096> buf{};
  for (ssize_t n; (n = ::read(fds[0], buf.data(), buf.size())) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    err.append(buf.data(), static_cast<std::size_t>(n));
    if (!signalled && err.find("float32 forward and backward") != std::string::npos) {
      ::kill(pid, SIGINT);  // during the float32 run
      signalled = true;
    }
  }
  ::close(fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(signalled) << err;
  ASSERT_TRUE(WIFEXITED(status)) << err;
  EXPECT_EQ(WEXITSTATUS(status), 130) << err;
  // The stop lands at the next stage boundary or tensor: under load that may be after the float32
  // run, so any stage is right, as long as nothing is written.
  EXPECT_NE(err.find("teo: interrupted "), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().extension(), ".json") << "left behind: " << e.path();
}

TEST(GoldenCli, GenerateRejectsBadCasesWithExitCode2AndWritesNothing) {
  const fs::path dir = fresh_dir("teo_golden_cli_bad");
  struct Bad {
    const char* json;
    const char* message;
  };
  for (
      const Bad& b : {
          Bad{"{", "not valid JSON"},
          Bad{R"({"d_model": 8})", "no \"case\""},
          Bad{R"({"case": {"batch": 2, "seq_len": 4, "dtype": "float16", "seed": 1}})", "dtype"},
          Bad{R"({"case": {"batch": 2, "seq_len": 4, "dtype": "float32"}})", "needs batch"},
          Bad{R"({"case": {"batch": 2, "seq_len": 4, "dtype": "float32", "seed": 1, "x": 1}})",
              "unknown key \"x\""},
          Bad{R"({"case": {"batch": 2, "seq_len": 99, "dtype": "float32", "seed": 1}})", "seq_len"},
          Bad{R"({"case": {"batch": 2, "seq_len": 4, "lengths": [5, 1], "dtype": "float32", "seed": 1}})",
              "lengths"},
          Bad{R"({"num_heads": 3, "case": {"batch": 2, "seq_len": 4, "dtype": "float32", "seed": 1}})",
              "num_heads"},
          // generation: a decoder's, at least one step, within max_len
          Bad{R"({"case": {"batch": 2, "seq_len": 4, "dtype": "float32", "seed": 1,
                           "generate": {"steps": 2}}})",
              "case.generate needs a decoder"},
          Bad{R"({"architecture": "decoder", "case": {"batch": 2, "seq_len": 4, "dtype":
                  "float64", "seed": 1, "generate": {"steps": 0}}})",
              "steps must be at least 1"},
          Bad{R"({"architecture": "decoder", "max_len": 8, "case": {"batch": 2, "seq_len": 4,
                  "dtype": "float64", "seed": 1, "generate": {"steps": 5}}})",
              "runs past max_len"},
          Bad{R"({"architecture": "decoder", "case": {"batch": 2, "seq_len": 4, "dtype":
                  "float64", "seed": 1, "generate": {"steps": 2, "prompt": 3}}})",
              "case.generate has the unknown key \"prompt\""},
      }) {
    std::ofstream(dir / "case.json", std::ios::trunc) << b.json;
    const CliResult r = run_cli("golden generate --config " + (dir / "case.json").string() +
                                " --out " + (dir / "g.safetensors").string());
    EXPECT_EQ(r.code, 2) << b.json << "\n" << r.out;
    EXPECT_NE(r.out.find(b.message), std::string::npos) << b.json << "\n" << r.out;
    EXPECT_FALSE(fs::exists(dir / "g.safetensors")) << b.json;
  }
  EXPECT_EQ(run_cli("golden generate --out x.safetensors").code, 2) << "--out needs --config";
  EXPECT_EQ(run_cli("golden generate --corpus /nonexistent").code, 2);
  const CliResult refused = run_cli("golden generate --corpus " + kCorpus.string());
  EXPECT_EQ(refused.code, 2) << "the corpus exists: regenerating it needs --force";
  EXPECT_NE(refused.out.find("--force"), std::string::npos) << refused.out;
  EXPECT_EQ(run_cli("golden generate --corpus " + kCorpus.string() + " --out x").code, 2);
}

// The golden `g` as a candidate with one wrong logit (7.0), written to `out`.
void write_wrong_logit_candidate(const std::string& g, const fs::path& out) {
  st::File c = st::read(g);
  for (auto& t : c.tensors) {
    if (t.name == "act.logits") {
      const double v = 7.0;
      std::memcpy(t.bytes.data(), &v, sizeof v);
    }
  }
  teo::write_file_atomic(out.string(), st::serialize(c), true);
}

TEST(GoldenCli, CheckExitCodesAndReports) {
  const fs::path dir = fresh_dir("teo_golden_cli_check");
  const std::string g = (kCorpus / "post_gelu_mean_f64.safetensors").string();
  // A golden holds every act./grad. tensor itself, so it passes as its own candidate.
  CliResult r = run_cli("golden check --golden " + g + " --candidate " + g + " --junit " +
                        (dir / "j.xml").string() + " --json " + (dir / "r.json").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("0 failed, 0 not checked"), std::string::npos) << r.out;
  EXPECT_NE(slurp(dir / "j.xml").find("<testsuites"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(slurp(dir / "r.json"))["failed"], 0);

  // One wrong logit: exit 1, and the first divergence is named.
  write_wrong_logit_candidate(g, dir / "c.safetensors");
  r = run_cli("golden check --golden " + g + " --candidate " + (dir / "c.safetensors").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("first divergence: logits"), std::string::npos) << r.out;
  r = run_cli("golden check --only backward --golden " + g + " --candidate " +
              (dir / "c.safetensors").string());
  EXPECT_EQ(r.code, 0) << "the forward-only error is outside --only backward\n" << r.out;

  // A candidate with none of the tensors checks nothing: that is not a pass.
  st::File empty;
  const std::vector<double> one = {1};
  empty.add<double>("unrelated", {1}, one.data(), 1);
  teo::write_file_atomic((dir / "e.safetensors").string(), st::serialize(empty), true);
  r = run_cli("golden check --golden " + g + " --candidate " + (dir / "e.safetensors").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("unrelated"), std::string::npos) << "a name not in the golden fails\n"
                                                        << r.out;
  r = run_cli("golden check --allow-extra --golden " + g + " --candidate " +
              (dir / "e.safetensors").string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("nothing was checked"), std::string::npos) << r.out;

  // Bad input: exit 2 with the file named.
  const std::string truncated = (dir / "t.safetensors").string();
  std::ofstream(truncated, std::ios::binary) << slurp(g).substr(0, 1000);
  r = run_cli("golden check --golden " + g + " --candidate " + truncated);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(truncated), std::string::npos) << r.out;
  r = run_cli("golden check --golden /nonexistent --candidate " + g);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("/nonexistent"), std::string::npos) << r.out;
  r = run_cli("golden check --golden " + g + " --candidate " + (dir / "e.safetensors").string() +
              " --only sideways");
  EXPECT_EQ(r.code, 2);
  r = run_cli("golden check --golden " + (dir / "e.safetensors").string() + " --candidate " + g);
  EXPECT_EQ(r.code, 2) << "a golden without teo-golden/1 metadata is bad input";
  EXPECT_NE(r.out.find("not a teo golden"), std::string::npos) << r.out;
}

// A report that cannot be written is reported on stderr, and the verdict stands: a pass stays 0
// and a failure stays 1 (docs/golden-format.md, "Exit status").
TEST(GoldenCli, AReportThatCannotBeWrittenKeepsTheVerdict) {
  const fs::path dir = fresh_dir("teo_golden_cli_report");
  const std::string g = (kCorpus / "post_gelu_mean_f64.safetensors").string();
  const std::string nowhere = (dir / "no" / "such" / "dir" / "r.xml").string();
  CliResult r = run_cli("golden check --golden " + g + " --candidate " + g + " --junit " + nowhere);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("report not written"), std::string::npos) << r.out;
  write_wrong_logit_candidate(g, dir / "c.safetensors");
  r = run_cli("golden check --golden " + g + " --candidate " + (dir / "c.safetensors").string() +
              " --json " + nowhere);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("report not written"), std::string::npos) << r.out;
}

// Without --force, a corpus whose manifest.json exists is not regenerated, even when none of its
// case files does, and nothing is written.
TEST(GoldenCli, GenerateCorpusRefusesAnExistingManifest) {
  const fs::path dir = fresh_dir("teo_golden_cli_manifest");
  auto cases = nlohmann::json::parse(slurp(kCorpus / "cases.json"));
  cases["cases"] = nlohmann::json::array({cases["cases"][0]});
  std::ofstream(dir / "cases.json") << cases.dump();
  std::ofstream(dir / "manifest.json") << "keep me";
  CliResult r = run_cli("golden generate --corpus " + dir.string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("manifest.json: already exists"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(dir / "manifest.json"), "keep me");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 2);
  r = run_cli("golden generate --corpus " + dir.string() + " --force");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(slurp(dir / "manifest.json"), "keep me");
}

// `golden op` writes the committed op case's bytes from its corpus entry, refuses to overwrite,
// and names a bad spec with exit 2 and no file; `golden list` prints what a candidate writes.
TEST(GoldenCli, OpWritesTheCommittedCaseAndListShowsItsContract) {
  const fs::path dir = fresh_dir("teo_golden_cli_op");
  const auto cases = nlohmann::json::parse(slurp(kCorpus / "ops" / "cases.json"))["cases"];
  for (const auto& c : cases) {
    if (c["name"] != "attention_causal_f64") continue;
    nlohmann::json spec = c;
    spec.erase("name");
    spec.erase("description");
    spec.erase("op");
    std::ofstream(dir / "spec.json") << spec.dump();
  }
  const std::string out = (dir / "a.safetensors").string();
  const std::string args =
      "golden op --op attention --spec " + (dir / "spec.json").string() + " --out " + out;
  CliResult r = run_cli(args);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(slurp(out) == slurp(kCorpus / "ops" / "attention_causal_f64.safetensors"));
  r = run_cli(args);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("already exists"), std::string::npos) << r.out;
  r = run_cli("golden list --golden " + out);
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* line :
       {"op attention  float64", "reads  input.q (2, 3, 5, 4) F64",
        "writes output.scores (2, 3, 5, 5)  (optional)", "writes output.context (2, 3, 5, 4)",
        "writes grad.input.v (2, 3, 5, 4)"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  r = run_cli("golden list --golden " + (kCorpus).string());
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("post_gelu_mean_f64.safetensors  model"), std::string::npos);
  EXPECT_NE(r.out.find("linear_f64.safetensors  op linear"), std::string::npos);
  // Bad specs: one line naming the problem, exit 2, nothing written.
  struct Bad {
    const char* op;
    const char* json;
    const char* message;
  };
  for (const Bad& b :
       {Bad{"linear", "{", "not valid JSON"},
        Bad{"conv", R"({"dtype": "float64", "seed": 1})", "unknown op \"conv\""},
        Bad{"linear", R"({"rows": 2, "in_features": 3, "dtype": "float64", "seed": 1})",
            "needs \"out_features\""},
        Bad{"softmax",
            R"({"rows": 2, "cols": 3, "visible": [1, 4], "dtype": "float64", "seed": 1})",
            "spec.visible has 4"}}) {
    std::ofstream(dir / "bad.json", std::ios::trunc) << b.json;
    const fs::path bad_out = dir / "bad.safetensors";
    r = run_cli(std::string("golden op --op ") + b.op + " --spec " + (dir / "bad.json").string() +
                " --out " + bad_out.string());
    EXPECT_EQ(r.code, 2) << b.json << "\n" << r.out;
    EXPECT_NE(r.out.find(b.message), std::string::npos) << r.out;
    EXPECT_FALSE(fs::exists(bad_out));
  }
}

// `golden op --keep '*'` on an fp8 linear case stores its products' fp8 operands with their
// scales; `golden list` shows them among what a backend reads, and the case still checks.
TEST(GoldenCli, OpKeepStoresAnFp8LinearCasesOperands) {
  const fs::path dir = fresh_dir("teo_golden_cli_fp8_keep");
  std::ofstream(dir / "spec.json")
      << R"({"op": "linear", "rows": 3, "in_features": 40, "out_features": 5, "dtype": "float32",
            "seed": 2, "precision": "fp8", "fp8_scaling": "mx"})";
  const std::string out = (dir / "k.safetensors").string();
  CliResult r =
      run_cli("golden op --spec " + (dir / "spec.json").string() + " --out " + out + " --keep '*'");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("golden list --golden " + out);
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* line : {"reads  fp8.y.x (3, 40) F8_E4M3", "reads  fp8.y.x.scale (3, 2) F32",
                           "reads  fp8.grad_weight.x (40, 3) F8_E4M3", "writes output.y (3, 5)"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  // its outputs are a float32 run's, judged as one (as fp8, its own precision, they are off the
  // recipe)
  r = run_cli("golden check --golden " + out + " --candidate " + out + " --precision fp32");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_cli("golden op --spec " + (dir / "spec.json").string() + " --out " + out +
              " --force --keep 'fp8.z.*'");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--keep pattern \"fp8.z.*\" matches no computed tensor"), std::string::npos)
      << r.out;
}

// A corpus with ops/ refuses as a whole: an existing op case stops generation before any file of
// either kind is written.
TEST(GoldenCli, GenerateCorpusRefusesAnExistingOpCaseBeforeWritingAnything) {
  const fs::path dir = fresh_dir("teo_golden_cli_ops_corpus");
  auto cases = nlohmann::json::parse(slurp(kCorpus / "cases.json"));
  cases["cases"] = nlohmann::json::array({cases["cases"][0]});
  std::ofstream(dir / "cases.json") << cases.dump();
  fs::create_directories(dir / "ops");
  auto ops = nlohmann::json::parse(slurp(kCorpus / "ops" / "cases.json"));
  ops["cases"] = nlohmann::json::array({ops["cases"][0]});
  std::ofstream(dir / "ops" / "cases.json") << ops.dump();
  const std::string op_file = ops["cases"][0]["name"].get<std::string>() + ".safetensors";
  std::ofstream(dir / "ops" / op_file) << "keep me";
  CliResult r = run_cli("golden generate --corpus " + dir.string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("already exists"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir / "manifest.json")) << "nothing is written";
  r = run_cli("golden generate --corpus " + dir.string() + " --force");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(slurp(dir / "ops" / op_file) == slurp(kCorpus / "ops" / op_file));
}

// A corpus run that fails half-way changes nothing: every case of the model corpus and of its op
// corpus is made before any file under its final name is replaced, and no temporary file stays.
// The failure here is a case whose file name is too long to create, once among the op cases
// (after the model cases were made) and once among the model cases.
TEST(GoldenCli, GenerateCorpusThatFailsHalfWayChangesNothing) {
  const fs::path dir = fresh_dir("teo_golden_cli_half");
  auto cases = nlohmann::json::parse(slurp(kCorpus / "cases.json"));
  cases["cases"] = nlohmann::json::array({cases["cases"][0]});
  auto ops = nlohmann::json::parse(slurp(kCorpus / "ops" / "cases.json"));
  ops["cases"] = nlohmann::json::array({ops["cases"][0]});
  fs::create_directories(dir / "ops");
  std::ofstream(dir / "cases.json") << cases.dump();
  std::ofstream(dir / "ops" / "cases.json") << ops.dump();
  ASSERT_EQ(run_cli("golden generate --corpus " + dir.string()).code, 0);
  const auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : fs::recursive_directory_iterator(dir))
      if (e.is_regular_file()) files[e.path().string()] = slurp(e.path());
    return files;
  };
  // every case changed (another seed), then one that cannot be written
  auto reseeded = [](nlohmann::json j) {
    for (auto& c : j["cases"]) {
      auto& seed = c.contains("case") ? c["case"]["seed"] : c["seed"];
      seed = seed.get<int>() + 1;
    }
    return j;
  };
  const auto too_long = [](nlohmann::json j) {
    auto extra = j["cases"][0];
    extra["name"] = std::string(300, 'x');
    j["cases"].push_back(extra);
    return j;
  };
  for (const bool in_ops : {true, false}) {
    std::ofstream(dir / "cases.json")
        << (in_ops ? reseeded(cases) : too_long(reseeded(cases))).dump();
    std::ofstream(dir / "ops" / "cases.json")
        << (in_ops ? too_long(reseeded(ops)) : reseeded(ops)).dump();
    const auto before = snapshot();
    const CliResult r = run_cli("golden generate --corpus " + dir.string() + " --force");
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("xxxxxxxx"), std::string::npos) << r.out;
    EXPECT_TRUE(snapshot() == before)
        << (in_ops ? "an op case" : "a model case")
        << " failed, and the corpus changed (or a temporary file stayed)";
  }
}

// A write error on standard output (a full disk) is not a success.
TEST(Cli, AWriteErrorOnStandardOutputIsNotSuccess) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  const std::string cmd = std::string(TEO_TEO_BINARY) + " shapes > /dev/full 2>/dev/null";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_EQ(run_cli("shapes").code, 0);
}

TEST(GoldenCli, DirectoriesAreMatchedByFileNameAndMissingFilesAreNotChecked) {
  const fs::path dir = fresh_dir("teo_golden_cli_dirs");
  fs::copy_file(kCorpus / "one_layer_f64.safetensors", dir / "one_layer_f64.safetensors");
  CliResult r =
      run_cli("golden check --golden " + kCorpus.string() + " --candidate " + dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("no candidate file"), std::string::npos);
  r = run_cli("golden check --require-all --golden " + kCorpus.string() + " --candidate " +
              dir.string());
  EXPECT_EQ(r.code, 1) << r.out;
  r = run_cli("golden check --golden " + kCorpus.string() + " --candidate " +
              (dir / "one_layer_f64.safetensors").string());
  EXPECT_EQ(r.code, 2) << "a directory golden needs a directory candidate";
}

// golden/ holds the model cases and golden/ops/ the op cases: one check covers both, each op case
// matched and reported by its path under the directory.
TEST(GoldenCli, CheckOfADirectoryDescendsIntoItsSubdirectories) {
  const fs::path dir = fresh_dir("teo_golden_cli_descend");
  fs::create_directories(dir / "ops");
  fs::copy_file(kCorpus / "one_layer_f64.safetensors", dir / "one_layer_f64.safetensors");
  fs::copy_file(kCorpus / "ops" / "linear_f64.safetensors", dir / "ops" / "linear_f64.safetensors");
  // an op case misplaced at the top is not matched with golden/ops/ (the paths differ)
  fs::copy_file(kCorpus / "ops" / "softmax_masked_f64.safetensors",
                dir / "softmax_masked_f64.safetensors");
  const std::string json = (dir / "report.json").string();
  CliResult r = run_cli("golden check --golden " + kCorpus.string() + " --candidate " +
                        dir.string() + " --json " + json);
  EXPECT_EQ(r.code, 1) << "the misplaced file has no golden of its name\n" << r.out;
  EXPECT_NE(r.out.find("did you mean ops/softmax_masked_f64.safetensors?"), std::string::npos)
      << r.out;
  const auto report = nlohmann::json::parse(slurp(json));
  std::map<std::string, int> passed;
  for (const auto& c : report.at("cases")) {
    if (c.contains("no_golden")) {
      EXPECT_EQ(c.at("name"), "softmax_masked_f64.safetensors");
      continue;
    }
    passed[c.at("name")] = c.at("passed").get<int>();
  }
  EXPECT_GT(passed.at("one_layer_f64.safetensors"), 0);
  EXPECT_GT(passed.at("ops/linear_f64.safetensors"), 0);
  EXPECT_EQ(passed.at("ops/softmax_masked_f64.safetensors"), 0);
  EXPECT_FALSE(passed.contains("softmax_masked_f64.safetensors"));
  EXPECT_GE(passed.size(), 140u) << "every model and op case of the corpus";
}

// A golden directory of symlinks is matched by the links' own names, never through their
// targets: a wrong candidate fails (it is not compared with the golden itself); and a candidate
// directory inside the golden one is not searched for goldens.
TEST(GoldenCli, SymlinkedGoldensAreMatchedByTheirOwnNames) {
  const fs::path dir = fresh_dir("teo_golden_cli_links");
  fs::create_directories(dir / "golden");
  fs::create_directories(dir / "golden" / "mine");
  const std::string name = "post_gelu_mean_f64.safetensors";
  fs::create_symlink(kCorpus / name, dir / "golden" / name);
  // the candidate: the golden with one activation doubled
  st::File c = st::read((kCorpus / name).string());
  for (auto& t : c.tensors) {
    if (t.name != "act.layers.0.context") continue;
    auto v = t.float_values();
    for (auto& x : v) x *= 2;
    std::memcpy(t.bytes.data(), v.data(), v.size() * sizeof(double));
  }
  teo::write_file_atomic((dir / "golden" / "mine" / name).string(), st::serialize(c), true);
  CliResult r = run_cli("golden check --golden " + (dir / "golden").string() + " --candidate " +
                        (dir / "golden" / "mine").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("first divergence: layers.0.context"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(".."), std::string::npos) << "names are the links' own: " << r.out;
}

TEST(Cli, EveryBadInputIsOneLineAndExitCode2) {
  const std::string g = (kCorpus / "post_gelu_mean_f64.safetensors").string();
  for (const std::string& args : std::vector<std::string>{
           "golden check --golden " + g,
           "golden check --golden " + g + " --candidate " + g + " --only x", "nosuchcommand",
           "shapes --batch -3", "bench --preset huge", "train --epochs", "predict",
           "golden generate --config /nonexistent/case.json --out /tmp/x.safetensors",
           "golden check --golden /nonexistent --candidate /nonexistent", "shapes --config " + g,
           "--threads 0 shapes", "train --lr fast"}) {
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << args << "\n" << r.out;
    EXPECT_TRUE(r.out.starts_with("teo: error: ")) << args << "\n" << r.out;
  }
  EXPECT_EQ(run_cli("--help").code, 0);
}

// A linear fp8 op case's own float32 outputs as the candidate: more accurate than fp8, but off its
// recipe (they are not fp8 products), so the recipe rule fails them by name; --fp8-recipe-k inf
// judges by the budget alone, and a negative k is a named error.
TEST(GoldenCli, Fp8RecipeKTurnsTheRecipeRuleOffAtInf) {
  const std::string g = (kCorpus / "ops" / "linear_fp8_tensor.safetensors").string();
  const std::string args =
      "golden check --precision fp8 --allow-extra --golden " + g + " --candidate " + g;
  CliResult r = run_cli(args);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("off the fp8 recipe"), std::string::npos) << r.out;
  r = run_cli(args + " --fp8-recipe-k inf");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_cli(args + " --fp8-recipe-k -1");
  EXPECT_EQ(r.code, 2) << r.out;  // a usage error
  EXPECT_NE(r.out.find("--fp8-recipe-k: must be a number >= 0 or inf"), std::string::npos) << r.out;
}

}  // namespace
