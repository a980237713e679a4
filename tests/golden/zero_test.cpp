// No tensor passes a zero: over every committed golden (model and op cases), judged in the
// golden's own precision, a candidate that is zero where the truth is not, or that is the truth
// negated, must fail each tensor or report it vacuous (not judged). Each file is checked once with
// every judged tensor zeroed at once (and once negated): the checker judges each tensor on its own
// values, so that is the same verdict as zeroing one tensor with the others the truth.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "golden/golden_internal.hpp"
#include "teo/golden.hpp"
#include "teo/golden_ops.hpp"
#include "teo/safetensors.hpp"
#include "test_paths.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = teo::safetensors;
using teo::golden::CaseReport;
using teo::golden::CheckOptions;
using teo::golden::Status;

enum class Mutant { zero, negated };

// Which tensors a candidate mutates: the float ones (the routing, I32, kept as the truth), or the
// routing alone (the floats kept as the truth). A routing is judged against a tolerance from the
// candidate's own router logits (golden-format.md, "Routing"): zeroing the logits with it would
// widen that tolerance, so each part is mutated with the other the truth, which is still the
// verdict of one tensor at a time.
enum class Part { floats, routing };

// The golden's judged tensors, zeroed or negated, in the golden's dtype (`part`'s mutated, the
// others the truth).
st::File mutant_of(const st::File& golden, Mutant m, Part part) {
  const bool op = teo::golden::is_op_file(golden);
  st::File c;
  for (const auto& t : golden.tensors) {
    if (!teo::golden::detail::is_judged(t.name, op)) continue;
    const bool mutate = (t.dtype == st::DType::I32) == (part == Part::routing);
    if (!mutate) {
      c.tensors.push_back(t);
      continue;
    }
    if (t.dtype == st::DType::I32) {
      // the experts a router chose: zeros, or the ids negated (no expert has one)
      auto ids = t.values<std::int32_t>();
      for (auto& x : ids) x = m == Mutant::zero ? 0 : -x - 1;
      c.add<std::int32_t>(t.name, t.shape, ids.data(), ids.size());
      continue;
    }
    if (!st::is_float(t.dtype)) {
      // a quantized cache's int8 codes: zeros, or negated (codes lie in [-127, 127])
      auto q = t.values<std::int8_t>();
      for (auto& x : q) x = static_cast<std::int8_t>(m == Mutant::zero ? 0 : -x);
      c.add<std::int8_t>(t.name, t.shape, q.data(), q.size());
      continue;
    }
    auto v = t.float_values();
    // a masked score's -inf stays: a zero there fails as a NaN/Inf mismatch, which would hide
    // whether the finite values are judged
    for (double& x : v) x = !std::isfinite(x) ? x : m == Mutant::zero ? 0.0 : -x;
    if (t.dtype == st::DType::F64) {
      c.add<double>(t.name, t.shape, v.data(), v.size());
    } else {
      const std::vector<float> f(v.begin(), v.end());
      c.add<float>(t.name, t.shape, f.data(), f.size());
    }
  }
  return c;
}

std::vector<fs::path> corpus_files() {
  std::vector<fs::path> out;
  const fs::path root = fs::path(TEO_SOURCE_DIR) / "golden";
  for (const fs::path& dir : {root, root / "ops"}) {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string precision_of(const st::File& g) {
  const bool op = teo::golden::is_op_file(g);
  const auto p = op ? teo::golden::op_case_of(g).precision : teo::golden::case_of(g).precision;
  if (p) return teo::to_string(*p);
  const auto dtype = op ? teo::golden::op_case_of(g).dtype : teo::golden::case_of(g).dtype;
  return dtype == "float32" ? "fp32" : "fp64";
}

struct Tally {
  int files = 0, judged = 0, zero_truth = 0, noise_only = 0;
  std::vector<std::string> vacuous;  // "file: tensor"
  std::vector<std::string> passes;   // "file: tensor (mutant, ratio)"
};

bool has_routing(const st::File& g) {
  return std::any_of(g.tensors.begin(), g.tensors.end(),
                     [](const auto& t) { return t.dtype == st::DType::I32; });
}

// Records every tensor of `part` with a nonzero truth that the mutant passes; `count`: this run's
// tensors go in the tally's counts.
void judge(const std::string& name, const st::File& g, Mutant m, Part part,
           const CheckOptions& opts, const char* how, Tally& tally) {
  const bool count = m == Mutant::zero && *how == 0;
  const CaseReport r = teo::golden::check(g, mutant_of(g, m, part), opts);
  EXPECT_EQ(r.precision, precision_of(g)) << name << ": judged in the golden's own precision";
  EXPECT_TRUE(r.notes.empty() || r.notes.front().find("judged as") == std::string::npos)
      << name << ": " << r.notes.front();
  for (const auto& t : r.tensors) {
    const st::Tensor* truth = g.find(t.name);
    ASSERT_NE(truth, nullptr) << name << ": " << t.name;
    if ((truth->dtype == st::DType::I32) != (part == Part::routing)) continue;  // the truth
    ASSERT_TRUE(t.compared) << name << ": " << t.name << ": " << t.message;
    // the truth is exactly 0 (max |zero - truth| = 0): a zero is the right answer
    if (t.max_abs == 0) {
      if (count) ++tally.zero_truth;
      continue;
    }
    // The one exception: the key bias gradient is 0 in exact arithmetic (softmax ignores a
    // per-row shift), and its truth is rounding noise, of either sign; a zero is right, and so is
    // that noise negated. It is judged by its own rule (golden-format.md, "noise-only").
    if (teo::golden::detail::noise_terms(g, t.name) > 0) {
      if (count) ++tally.noise_only;
      continue;
    }
    if (count) ++tally.judged;
    if (t.status == Status::vacuous) {
      if (count) tally.vacuous.push_back(name + ": " + t.name);
      continue;
    }
    if (t.status != Status::fail) {
      tally.passes.push_back(name + ": " + t.name + " (" +
                             (m == Mutant::zero ? "zero" : "negated") + how + ", " +
                             std::to_string(t.ratio) + " of its bound)");
    }
  }
}

TEST(ZeroCandidate, NoTensorOfTheCorpusPassesAZeroOrANegation) {
  Tally tally;
  CheckOptions off_recipe;
  off_recipe.fp8_recipe_k = INFINITY;  // docs/fp8.md: for float32 or off-recipe fp8 backends
  for (const auto& path : corpus_files()) {
    const st::File g = st::read(path.string());
    const std::string name = path.parent_path().filename().string() + "/" + path.stem().string();
    ++tally.files;
    for (Mutant m : {Mutant::zero, Mutant::negated}) {
      judge(name, g, m, Part::floats, {}, "", tally);
      if (has_routing(g)) judge(name, g, m, Part::routing, {}, "", tally);
      if (precision_of(g) == "fp8") {
        judge(name, g, m, Part::floats, off_recipe, ", --fp8-recipe-k inf", tally);
        if (has_routing(g))
          judge(name, g, m, Part::routing, off_recipe, ", --fp8-recipe-k inf", tally);
      }
    }
  }
  std::string list;
  for (const auto& p : tally.passes) list += "\n  " + p;
  EXPECT_TRUE(tally.passes.empty())
      << tally.passes.size() << " tensor(s) pass a wrong answer:" << list;
  // the corpus as committed: 253 files; the counts are docs/testing.md's ("No tensor passes a
  // zero")
  EXPECT_GE(tally.files, 240);
  std::cout << "zero test: " << tally.files << " files, " << tally.judged
            << " judged tensors with a nonzero truth, " << tally.vacuous.size()
            << " of them vacuous; " << tally.noise_only << " noise-only key bias gradients; "
            << tally.zero_truth << " with an exactly-zero truth\nvacuous:";
  for (const auto& v : tally.vacuous) std::cout << "\n  " << v;
  std::cout << "\n";
}

}  // namespace
