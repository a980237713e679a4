// The rule that decides whether an FMA peak can be trusted (teo::bench::assess_peak) and the
// fraction of peak that is never above 1 (teo::bench::fraction_of_peak), on fake probes whose
// rounds return chosen rates; and the CPU identification `teo bench` prints beside the ISA.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "teo/backend.hpp"
#include "teo/bench.hpp"
#include "teo/errors.hpp"

namespace {

using teo::bench::assess_peak;
using teo::bench::fraction_of_peak;
using teo::bench::Peak;

// A fake probe: one thread runs at `one` GFLOP/s; n threads at `scaled(n, call)` for the call-th
// n-thread round. Counts the rounds of each kind.
struct FakeProbe {
  double one = 100;
  std::function<double(int, int)> scaled;
  int one_rounds = 0, n_rounds = 0;
  std::function<double(int)> round() {
    return [this](int threads) {
      if (threads == 1) {
        ++one_rounds;
        return one;
      }
      return scaled(threads, n_rounds++);
    };
  }
};

TEST(Peak, ThreadsThatScaleGiveAReliablePeakAtTheFirstAttempt) {
  FakeProbe f;
  f.scaled = [](int n, int call) { return 100.0 * n - (call % 3); };  // 200, 199, 198, ...
  const Peak p = assess_peak(f.round(), 2, 2, 5);
  EXPECT_TRUE(p.reliable);
  EXPECT_EQ(p.attempts, 1);
  EXPECT_DOUBLE_EQ(p.gflops, 200);
  EXPECT_DOUBLE_EQ(p.min_gflops, 198);
  EXPECT_DOUBLE_EQ(p.median_gflops, 199);
  EXPECT_DOUBLE_EQ(p.one_thread_gflops, 100);
  EXPECT_EQ(f.one_rounds, 5);
  EXPECT_EQ(f.n_rounds, 5);
}

// The case: both probe threads ran at one core's rate. Every attempt fails the rule, the
// probe retries kPeakAttempts times, and the peak is reported as unreliable.
TEST(Peak, ThreadsAtOneCoresRateAreRetriedThenMarkedUnreliable) {
  FakeProbe f;
  f.scaled = [](int, int) { return 101.0; };
  const Peak p = assess_peak(f.round(), 2, 2, 4);
  EXPECT_FALSE(p.reliable);
  EXPECT_EQ(p.attempts, teo::bench::kPeakAttempts);
  EXPECT_EQ(f.n_rounds, 4 * teo::bench::kPeakAttempts);
  EXPECT_EQ(f.one_rounds, 4 * teo::bench::kPeakAttempts);
  EXPECT_DOUBLE_EQ(p.gflops, 101);
}

// A first attempt disturbed by another process, a second one clean: the second is kept, reliable.
TEST(Peak, ARetryThatScalesIsKeptAndReliable) {
  FakeProbe f;
  f.scaled = [](int n, int call) { return call < 3 ? 120.0 : 95.0 * n; };
  const Peak p = assess_peak(f.round(), 2, 2, 3);
  EXPECT_TRUE(p.reliable);
  EXPECT_EQ(p.attempts, 2);
  EXPECT_DOUBLE_EQ(p.gflops, 190);
}

// The threshold itself: exactly kPeakScaling * cores * one passes; just below fails.
TEST(Peak, TheRuleIsEightyPercentOfCoresTimesOneThread) {
  for (const double rate : {0.8 * 4 * 100, 0.8 * 4 * 100 - 0.5}) {
    FakeProbe f;
    f.scaled = [rate](int, int) { return rate; };
    const Peak p = assess_peak(f.round(), 4, 4, 2);
    EXPECT_EQ(p.reliable, rate >= teo::bench::kPeakScaling * 4 * 100) << rate;
  }
  // More threads than CPUs: the rule counts the CPUs (3 cores for 7 threads).
  FakeProbe f;
  f.scaled = [](int, int) { return 250.0; };
  EXPECT_TRUE(assess_peak(f.round(), 7, 3, 2).reliable);
  EXPECT_FALSE(assess_peak(f.round(), 7, 4, 2).reliable);
  // One thread is its own yardstick.
  FakeProbe one;
  one.scaled = [](int, int) { return 0.0; };
  const Peak p1 = assess_peak(one.round(), 1, 1, 3);
  EXPECT_TRUE(p1.reliable);
  EXPECT_EQ(one.n_rounds, 0);
  EXPECT_DOUBLE_EQ(p1.gflops, 100);
}

TEST(Peak, BadArgumentsAreNamed) {
  FakeProbe f;
  f.scaled = [](int, int) { return 1.0; };
  EXPECT_THROW(assess_peak(f.round(), 2, 2, 0), teo::ConfigError);
  EXPECT_THROW(assess_peak(f.round(), 2, 3, 1), teo::ConfigError);
  EXPECT_THROW(assess_peak(f.round(), 0, 0, 1), teo::ConfigError);
}

// A rate above the peak is a probe error, never a fraction; at or below it, the plain ratio.
TEST(Peak, AFractionAboveOneIsAProbeErrorNotAResult) {
  Peak p;
  p.gflops = 160;
  EXPECT_DOUBLE_EQ(*fraction_of_peak(80, p), 0.5);
  EXPECT_DOUBLE_EQ(*fraction_of_peak(160, p), 1.0);
  EXPECT_FALSE(fraction_of_peak(179, p).has_value());  // the "1.12 of peak"
  EXPECT_FALSE(fraction_of_peak(std::nan(""), p).has_value());
  p.gflops = 0;
  EXPECT_FALSE(fraction_of_peak(1, p).has_value());
}

// The measured probe keeps its promise on this machine's CPUs: pinned threads, one per CPU up to
// the CPUs this process may use, and a peak no lower than one thread's rate.
TEST(Peak, TheMeasuredProbePinsItsThreadsAndReportsTheRule) {
  teo::ScopedSettings restore;
  teo::set_backend(teo::Backend::simd);
  teo::set_num_threads(2);
  const Peak p = teo::bench::fma_peak<double>(2);
  EXPECT_TRUE(p.pinned);
  EXPECT_GE(p.cores, 1);
  EXPECT_LE(p.cores, 2);
  EXPECT_GE(p.attempts, 1);
  EXPECT_LE(p.attempts, teo::bench::kPeakAttempts);
  EXPECT_GT(p.one_thread_gflops, 0.0);
  EXPECT_EQ(p.reliable, p.gflops >= teo::bench::kPeakScaling * p.cores * p.one_thread_gflops);
}

TEST(Cpu, IdentifiesTheVendorAndOnX86TheFamilyAndModel) {
  const teo::CpuInfo& c = teo::cpu_info();
  EXPECT_FALSE(c.vendor.empty());
#if defined(__x86_64__)
  EXPECT_TRUE(c.vendor == "GenuineIntel" || c.vendor == "AuthenticAMD" || c.vendor.size() == 12)
      << c.vendor;
  EXPECT_GT(c.family, 0);
  EXPECT_NE(c.describe().find(" family " + std::to_string(c.family) + " model "), std::string::npos)
      << c.describe();
#endif
  EXPECT_EQ(c.describe().rfind(c.vendor, 0), 0u) << c.describe();
}

}  // namespace
