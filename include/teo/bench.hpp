// Timing the encoder: the benchmark presets, the FLOP convention, and a measurement of forward
// and forward+backward with the per-stage times of teo/profile.hpp. `teo bench` prints it.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "teo/config.hpp"
#include "teo/profile.hpp"

namespace teo::bench {

struct Preset {
  ModelConfig config;
  index_t batch = 0, seq_len = 0;
};

// "bert-base" (2 layers of BERT-base, B 8, S 128) or "small" (4 layers of width 256, B 32, S 64);
// ConfigError naming any other name.
Preset preset(const std::string& name);

// Forward FLOPs of the whole stack by the project's convention: per layer
// 8 B S D^2 + 4 B S^2 D + 4 B S D F; forward+backward is 3x that.
double forward_flops(const ModelConfig& cfg, index_t batch, index_t seq_len);

// The GEMM FLOPs of each timed stage that has them, per run (backward stages do twice as many as
// their forward ones).
std::map<profile::Stage, double> stage_flops(const ModelConfig& cfg, index_t batch,
                                             index_t seq_len);

struct Result {
  std::vector<double> fwd_ms, fwd_bwd_ms;  // one per timed run
  std::vector<profile::Timing> stages;     // summed over the timed runs
  double flops = 0;                        // forward_flops of the preset
};

// `warmup` untimed runs, then `repeats` timed runs of forward and backward on the current
// backend, ISA and thread count, emulating `precision` when it is set (ForwardOptions).
// ConfigError when repeats < 1 or warmup < 0.
template <class Real>
Result measure(const Preset& p, int repeats, int warmup,
               std::optional<Precision> precision = std::nullopt);

double median(std::vector<double> v);

// The machine's FMA peak for Real on the ISA selected and num_threads() threads, measured: every
// thread runs `chains` independent fused multiply-add chains on the ISA's widest vectors (2 FLOPs
// per lane and step) for about 20 ms, pinned to its own CPU of those this process may run on; a
// round's rate is all threads' FLOPs over the time from the common start to the last thread's end.
// The peak (gflops) is the best of `rounds` rounds: what the hardware does when nothing else runs,
// since on a shared machine other work only ever slows a round down; the median is kept beside it,
// for the spread. One thread alone is measured the same way, and the peak is trusted only when the
// threads scale (assess_peak). ConfigError when rounds < 1.
struct Peak {
  double gflops = 0, median_gflops = 0, min_gflops = 0;
  double one_thread_gflops = 0;  // the best round of one thread alone
  int chains = 0, lanes = 0, threads = 0, rounds = 0;
  int cores = 0;          // the CPUs the threads ran on: min(threads, CPUs this process may use)
  bool pinned = false;    // each thread was pinned to its CPU
  int attempts = 0;       // measurements taken, retries included
  bool reliable = false;  // gflops >= kPeakScaling * cores * one_thread_gflops
  std::string isa;
};
template <class Real>
Peak fma_peak(int rounds = 15);

// The threads of a peak must reach this share of `cores` times one thread's rate: below it, some
// of them shared a core (another process, a hypervisor), and the peak would be too low.
inline constexpr double kPeakScaling = 0.8;
// How many times a peak that fails the rule is measured before it is reported as unreliable.
inline constexpr int kPeakAttempts = 3;

// The rule behind fma_peak, on any probe: round(t) runs one round on t threads and returns its
// GFLOP/s. Each attempt takes the best of `rounds` rounds of one thread, then of `threads`
// threads; an attempt whose threads reach kPeakScaling * cores * one thread's rate ends the
// measurement as reliable. After kPeakAttempts failures the attempt with the best n-thread rate is
// returned with reliable = false. ConfigError when rounds, threads or cores are below 1.
Peak assess_peak(const std::function<double(int threads)>& round, int threads, int cores,
                 int rounds);

// gflops as a fraction of the peak; nothing when it is above 1 (or the peak is not positive): no
// computation outruns the FMA units, so such a fraction means the probe measured too little, a
// probe error, never a result.
std::optional<double> fraction_of_peak(double gflops, const Peak& peak);

}  // namespace teo::bench
