// `teo train` and `teo predict` as processes: output, files, resume and exit codes.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli/run_cli.hpp"
#include "support.hpp"
#include "teo/files.hpp"
#include "teo/safetensors.hpp"
#include "teo/train/checkpoint.hpp"
#include "train/word_lists.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using teo::test::fake_lists;

using teo::test::CliResult;
using teo::test::run_cli;

// The flags of a model small enough to train in a fraction of a second on the fake word lists.
std::string tiny_model(const fs::path& lists) {
  return " --data-dir " + lists.string() +
         " --d-model 8 --num-heads 2 --d-ff 16 --num-layers 1 --per-language 40";
}

TEST(TrainCli, TrainsPredictsAndNamesBadInput) {
  const fs::path lists = fake_lists("teo_train_cli");
  const fs::path out = fs::path(::testing::TempDir()) / "teo_train_cli_out";
  fs::remove_all(out);
  CliResult r = run_cli("train --out " + out.string() + tiny_model(lists) +
                        " --epochs 2 --batch-size 16 --lr 0.02 --warmup-steps 2 --no-plot");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* part :
       {"validation loss", "test accuracy", "naive Bayes", "confusion matrix", "tok/s", "ETA"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  r = run_cli("predict --checkpoint " + (out / "checkpoint.safetensors").string() +
              " abcing abczione");
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream lines(r.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    ++n;
    double total = 0;
    for (const char* code : {" en ", " de ", " fr ", " es ", " it "}) {
      const auto at = line.find(code);
      ASSERT_NE(at, std::string::npos) << line;
      total += std::stod(line.substr(at + 4));
    }
    EXPECT_NEAR(total, 1.0, 0.01) << line;
  }
  EXPECT_EQ(n, 2);
  r = run_cli("train --data-dir /nonexistent --out " + out.string() + " --no-plot");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("apt-get install wamerican"), std::string::npos) << r.out;
  r = run_cli("train --help");
  EXPECT_EQ(r.code, 0);
  for (const char* part : {"--lr TEXT", "default 0.004", "--shards TEXT", "--ema TEXT",
                           "--pooling TEXT", "default mean"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  r = run_cli("train --epochs 3x");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--epochs takes an integer"), std::string::npos) << r.out;
  r = run_cli("predict --checkpoint " + (lists / "french").string() + " mot");
  EXPECT_EQ(r.code, 2) << "a file that is not a checkpoint";
}

// The attention variants as flags: a GQA + RoPE + window + sinks model trains, predicts from its
// checkpoint (which holds the sinks), and a bad variant value is a named error before training.
TEST(TrainCli, TrainsWithAttentionVariantsAndNamesTheirBadValues) {
  const fs::path lists = fake_lists("teo_train_cli_variants");
  const fs::path out = fs::path(::testing::TempDir()) / "teo_train_cli_variants_out";
  fs::remove_all(out);
  CliResult r = run_cli("train --out " + out.string() + " --data-dir " + lists.string() +
                        " --d-model 8 --num-heads 4 --num-kv-heads 2 --positional rope"
                        " --sliding-window 3 --attn-logit-softcap 5 --attn-sinks true --d-ff 16"
                        " --num-layers 1 --per-language 40 --epochs 1 --batch-size 16 --no-plot");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("test accuracy"), std::string::npos) << r.out;
  bool sinks = false;
  for (const auto& t : teo::safetensors::read((out / "checkpoint.safetensors").string()).tensors)
    sinks |= t.name == "param.layers.0.attn.sinks";
  EXPECT_TRUE(sinks);
  r = run_cli("predict --checkpoint " + (out / "checkpoint.safetensors").string() + " abcing");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_cli("train --out " + out.string() + tiny_model(lists) + " --sliding-window 0");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("sliding_window must be >= 1"), std::string::npos) << r.out;
  r = run_cli("train --out " + out.string() + tiny_model(lists) + " --num-kv-heads 3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("num_kv_heads"), std::string::npos) << r.out;
}

// The language-model demo: a small decoder trains, reports its test perplexity next to the
// character-trigram model's (summary.json too), and predict refuses its checkpoint by name.
TEST(TrainCli, TrainsADecoderAndReportsPerplexityAgainstTheTrigramModel) {
  const fs::path lists = fake_lists("teo_train_cli_lm");
  const fs::path out = fs::path(::testing::TempDir()) / "teo_train_cli_lm_out";
  fs::remove_all(out);
  const fs::path trace = fs::path(::testing::TempDir()) / "teo_train_cli_lm_trace.safetensors";
  CliResult r = run_cli("train --architecture decoder --out " + out.string() + tiny_model(lists) +
                        " --norm rmsnorm --ffn swiglu --activation silu --positional rope"
                        " --tie-embeddings true --epochs 2 --batch-size 16 --no-plot --trace " +
                        trace.string());
  ASSERT_EQ(r.code, 0) << r.out;
  bool labels = false, tokens = false;
  for (const auto& t : teo::safetensors::read(trace.string()).tensors) {
    labels |= t.name.ends_with(".labels");
    tokens |= t.name.ends_with(".tokens");
  }
  EXPECT_TRUE(tokens);
  EXPECT_FALSE(labels) << "a language model's batches have no labels";
  for (const char* part : {"\"architecture\":\"decoder\"", "\"causal\":true", "perplexity",
                           "test perplexity", "character-trigram model", "next-token accuracy"}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("confusion matrix"), std::string::npos) << r.out;
  const auto summary = nlohmann::json::parse(teo::test::slurp(out / "summary.json"));
  const double ppl = summary.at("test_perplexity"), tri = summary.at("trigram_test_perplexity");
  // both are perplexities of distributions over the vocabulary: between 1 and its size
  EXPECT_GT(ppl, 1.0);
  EXPECT_GT(tri, 1.0);
  EXPECT_LT(tri, 64.0);
  EXPECT_GT(summary.at("test_tokens").get<int>(), 0);
  r = run_cli("predict --checkpoint " + (out / "checkpoint.safetensors").string() + " abcing");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("language model"), std::string::npos) << r.out;
  r = run_cli("train --architecture decoder --causal false --out " + out.string() +
              tiny_model(lists) + " --no-plot");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("causal"), std::string::npos) << r.out;
  // resuming with keys at the checkpoint's values (defaults included) changes nothing
  r = run_cli("train --resume " + (out / "checkpoint.safetensors").string() + " --out " +
              out.string() +
              " --epochs 3 --no-plot --architecture decoder --ffn-bias true"
              " --tie-embeddings true --norm rmsnorm");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_cli("train --resume " + (out / "checkpoint.safetensors").string() + " --out " +
              out.string() + " --epochs 4 --no-plot --ffn-bias false");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("ffn_bias cannot be changed from its default"), std::string::npos) << r.out;
}

std::string param_bytes(const fs::path& checkpoint) {
  std::string s;
  for (const auto& t : teo::safetensors::read(checkpoint.string()).tensors) {
    if (t.name.starts_with("param.") || t.name.starts_with("adam.") || t.name.starts_with("ema.")) {
      s += t.name;
      s.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    }
  }
  return s;
}

// Two epochs in one run give the bits of one epoch, then --resume for the second.
TEST(TrainCli, ResumingAfterOneEpochGivesTheSameBitsAsTwoEpochsInOneRun) {
  const fs::path lists = fake_lists("teo_train_cli_resume");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_cli_resume_out";
  fs::remove_all(root);
  const std::string common = tiny_model(lists) +
                             " --batch-size 16 --accum-steps 2 --warmup-steps 3"
                             " --lr 0.01 --clip-norm 0.5 --dropout 0.1 --no-plot --no-progress";
  auto r = teo::test::run_cli("train --epochs 2 --out " + (root / "both").string() + common);
  ASSERT_EQ(r.code, 0) << r.out;
  r = teo::test::run_cli("train --epochs 1 --out " + (root / "split").string() + common);
  ASSERT_EQ(r.code, 0) << r.out;
  r = teo::test::run_cli("train --epochs 2 --out " + (root / "split").string() + " --resume " +
                         (root / "split" / "checkpoint-epoch1.safetensors").string() +
                         " --no-plot --no-progress");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string a = param_bytes(root / "both" / "checkpoint-epoch2.safetensors");
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == param_bytes(root / "split" / "checkpoint-epoch2.safetensors"));
  EXPECT_FALSE(a == param_bytes(root / "both" / "checkpoint-epoch1.safetensors"));
  for (const char* f : {"metrics.csv", "summary.json"}) EXPECT_TRUE(fs::exists(root / "both" / f));
  r = teo::test::run_cli("train --lr 0.5 --out " + (root / "split").string() + " --resume " +
                         (root / "split" / "checkpoint-epoch1.safetensors").string());
  EXPECT_EQ(r.code, 2) << "a changed setting on resume is refused";
  EXPECT_NE(r.out.find("lr cannot be changed"), std::string::npos) << r.out;
}

// The rows of metrics.csv without the throughput column (the only one that is timing).
std::vector<std::string> metric_rows(const fs::path& csv) {
  std::ifstream in(csv);
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(line.substr(0, line.rfind(',')));
  return rows;
}

// A resumed run keeps the checkpoint's plan (epochs, max_steps) unless a flag changes it, accepts
// the same --config file again, and replaces the metrics rows the first run wrote after the
// checkpoint instead of repeating them: the interrupted-and-resumed run ends with the bits and the
// metrics.csv of the uninterrupted one.
TEST(TrainCli, ResumeWithoutFlagsContinuesTheSavedPlanAndDropsLaterMetrics) {
  const fs::path lists = fake_lists("teo_train_cli_plan");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_cli_plan_out";
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path config = root / "run.json";
  std::ofstream(config) << R"({"d_model": 8, "num_heads": 2, "d_ff": 16, "num_layers": 1,
    "batch_size": 16, "accum_steps": 2, "per_language": 40, "warmup_steps": 3, "lr": 0.01,
    "dropout": 0.1, "epochs": 3, "max_steps": 9})";
  const std::string common =
      " --config " + config.string() + " --data-dir " + lists.string() + " --no-plot --no-progress";
  auto r = teo::test::run_cli("train --out " + (root / "whole").string() + common);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_NE(r.out.find("stopped at step 9"), std::string::npos) << r.out;
  // The same run again, resumed from its first epoch in its own directory.
  r = teo::test::run_cli("train --out " + (root / "again").string() + common);
  ASSERT_EQ(r.code, 0) << r.out;
  r = teo::test::run_cli("train --out " + (root / "again").string() + " --resume " +
                         (root / "again" / "checkpoint-epoch1.safetensors").string() + common);
  ASSERT_EQ(r.code, 0) << "the same --config file is accepted on resume\n" << r.out;
  EXPECT_NE(r.out.find("stopped at step 9"), std::string::npos) << r.out;
  const std::string whole = param_bytes(root / "whole" / "checkpoint.safetensors");
  ASSERT_FALSE(whole.empty());
  EXPECT_TRUE(whole == param_bytes(root / "again" / "checkpoint.safetensors"));
  const auto rows = metric_rows(root / "again" / "metrics.csv");
  EXPECT_EQ(rows, metric_rows(root / "whole" / "metrics.csv"))
      << "the resumed run's metrics.csv repeats or loses rows";
  // Without --config or flags, the plan is the checkpoint's too.
  r = teo::test::run_cli("train --no-plot --no-progress --out " + (root / "bare").string() +
                         " --resume " +
                         (root / "whole" / "checkpoint-epoch1.safetensors").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("stopped at step 9"), std::string::npos) << r.out;
  EXPECT_TRUE(whole == param_bytes(root / "bare" / "checkpoint.safetensors"));
  // A flag still changes how long to go on.
  r = teo::test::run_cli("train --no-plot --no-progress --max-steps 7 --out " +
                         (root / "short").string() + " --resume " +
                         (root / "whole" / "checkpoint-epoch1.safetensors").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("stopped at step 7"), std::string::npos) << r.out;
}

// Every output path is checked before the data is read or a step is taken.
TEST(TrainCli, BadOutputPathsFailBeforeTraining) {
  const fs::path lists = fake_lists("teo_train_cli_paths");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_cli_paths_out";
  fs::remove_all(root);
  fs::create_directories(root);
  std::ofstream(root / "a_file") << "x";
  const std::string common = " --data-dir " + lists.string() + " --per-language 40 --no-plot";
  // A trace whose directory cannot be made (a file stands in its path).
  auto r = teo::test::run_cli("train --out " + (root / "ok").string() + " --trace " +
                              (root / "a_file" / "dir" / "t.safetensors").string() + common);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find((root / "a_file" / "dir").string()), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("data:"), std::string::npos) << "it read the data first\n" << r.out;
  r = teo::test::run_cli("train --out " + (root / "a_file").string() + common);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("not a directory"), std::string::npos) << r.out;
  r = teo::test::run_cli("train --out " + (root / "ok").string() + " --trace " + root.string() +
                         common);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("is a directory"), std::string::npos) << r.out;
}

// gnuplot runs without a shell: an output directory named with quotes, spaces and $(...) gets its
// curves.png, and nothing in the name is executed.
TEST(TrainCli, PlotsIntoADirectoryNamedWithQuotesSpacesAndCommandSubstitution) {
  const fs::path lists = fake_lists("teo_train_cli_plot");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_cli_plot_out";
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path out = root / "it's a \"dir\" $(touch pwned) `touch pwned2`";
  const auto r = teo::test::run_cli("train --epochs 1 --no-progress" + tiny_model(lists) +
                                    " --out " + teo::test::shell_quote(out.string()));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(out / "curves.png")) << r.out;
  EXPECT_FALSE(fs::exists(root / "pwned"));
  EXPECT_FALSE(fs::exists(out / "pwned"));
  EXPECT_FALSE(fs::exists("pwned"));
  EXPECT_FALSE(fs::exists("pwned2"));
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
    EXPECT_NE(e.path().extension(), ".gp") << "the gnuplot script was left behind";
  }
}

// A loss that is not finite exits 3 (not 2, which means bad input), and names the step.
TEST(TrainCli, DivergenceExitsThree) {
  const fs::path lists = fake_lists("teo_train_cli_nan");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_cli_nan_out";
  fs::remove_all(root);
  const std::string common = tiny_model(lists) + " --no-plot --no-progress";
  auto r = teo::test::run_cli("train --epochs 1 --out " + (root / "a").string() + common);
  ASSERT_EQ(r.code, 0) << r.out;
  // The same checkpoint with a NaN in the head's bias.
  auto file = teo::safetensors::read((root / "a" / "checkpoint.safetensors").string());
  for (auto& t : file.tensors) {
    if (t.name == "param.head.bias") {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::memcpy(t.bytes.data(), &nan, sizeof nan);
    }
  }
  const fs::path bad = root / "nan.safetensors";
  teo::write_file_atomic(bad.string(), teo::safetensors::serialize(file), true);
  r = teo::test::run_cli("train --epochs 2 --no-plot --no-progress --out " + (root / "b").string() +
                         " --resume " + bad.string());
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("training diverged"), std::string::npos) << r.out;
}

// SIGINT finishes the step in progress, writes checkpoint.safetensors atomically and exits 130,
// with no temporary file left; resuming from it gives the bits of a run never interrupted.
TEST(TrainCli, InterruptSavesACheckpointAndResumesBitExactly) {
  const fs::path lists = fake_lists("teo_train_cli_sigint");
  const fs::path root = fs::path(::testing::TempDir()) / "teo_train_cli_sigint_out";
  fs::remove_all(root);
  fs::create_directories(root);
  const std::vector<std::string> common = {
      "--data-dir", lists.string(), "--d-model",    "8",      "--num-heads",    "2",
      "--d-ff",     "16",           "--num-layers", "1",      "--per-language", "40",
      "--dropout",  "0.1",          "--epochs",     "100000", "--no-plot",      "--no-progress"};
  std::vector<std::string> args = {TEO_TEO_BINARY, "train", "--out", (root / "cut").string()};
  args.insert(args.end(), common.begin(), common.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = (root / "cut.log").string();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  // Wait for the first validation (a whole epoch done), then interrupt.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(root / "cut" / "checkpoint-epoch1.safetensors") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  std::ifstream in(log);
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_EQ(WEXITSTATUS(status), 130) << out;
  EXPECT_NE(out.find("interrupted at step"), std::string::npos) << out;
  for (const auto& e : fs::directory_iterator(root / "cut")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  const auto ck = teo::train::read_checkpoint((root / "cut" / "checkpoint.safetensors").string());
  const std::string stop_at = std::to_string(ck.position.step + 3);
  std::string flags;
  for (const auto& c : common) flags += " " + c;
  auto r = teo::test::run_cli("train --max-steps " + stop_at + " --no-plot --no-progress --out " +
                              (root / "cut").string() + " --resume " +
                              (root / "cut" / "checkpoint.safetensors").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = teo::test::run_cli("train --max-steps " + stop_at + " --out " + (root / "whole").string() +
                         flags);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string whole = param_bytes(root / "whole" / "checkpoint.safetensors");
  ASSERT_FALSE(whole.empty());
  EXPECT_TRUE(whole == param_bytes(root / "cut" / "checkpoint.safetensors"));
}

}  // namespace
