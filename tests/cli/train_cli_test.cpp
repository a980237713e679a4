// `teo train` and `teo predict` as processes: output, files, resume and exit codes.
#include <filesystem>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "cli/run_cli.hpp"
#include "teo/safetensors.hpp"
#include "train/word_lists.hpp"

namespace {

namespace fs = std::filesystem;
using teo::test::fake_lists;

using teo::test::CliResult;
using teo::test::run_cli;

TEST(TrainCli, TrainsPredictsAndNamesBadInput) {
  const fs::path lists = fake_lists("teo_train_cli");
  const fs::path out = fs::path(::testing::TempDir()) / "teo_train_cli_out";
  fs::remove_all(out);
  CliResult r = run_cli("train --data-dir " + lists.string() + " --out " + out.string() +
                        " --d-model 8 --num-heads 2 --d-ff 16 --num-layers 1 --per-language 40"
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
  const std::string common = " --data-dir " + lists.string() +
                             " --d-model 8 --num-heads 2 --d-ff 16 --num-layers 1"
                             " --batch-size 16 --accum-steps 2 --per-language 40 --warmup-steps 3"
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

}  // namespace
