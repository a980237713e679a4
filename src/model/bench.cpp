#include "teo/bench.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "kernels/kernels_internal.hpp"
#include "teo/backend.hpp"
#include "teo/model.hpp"

namespace teo::bench {

Preset preset(const std::string& name) {
  Preset p;
  ModelConfig& c = p.config;
  c.ffn.activation = Activation::gelu;
  c.norms.norm_first = false;
  c.head.num_classes = 2;
  c.embeddings.vocab_size = 30522;
  if (name == "bert-base") {
    c.d_model = 768;
    c.attention.num_heads = 12;
    c.ffn.d_ff = 3072;
    c.num_layers = 2;
    p.batch = 8;
    p.seq_len = 128;
  } else if (name == "small") {
    c.d_model = 256;
    c.attention.num_heads = 8;
    c.ffn.d_ff = 1024;
    c.num_layers = 4;
    p.batch = 32;
    p.seq_len = 64;
  } else {
    throw ConfigError("preset must be bert-base or small, got \"" + name + "\"");
  }
  c.embeddings.max_len = p.seq_len;
  c.validate();
  return p;
}

double forward_flops(const ModelConfig& c, index_t batch, index_t seq_len) {
  const double B = static_cast<double>(batch), S = static_cast<double>(seq_len);
  const double D = static_cast<double>(c.d_model), F = static_cast<double>(c.ffn.d_ff);
  // a gated FFN's third product (the gate) adds a third of its two
  const double ffn = (c.gated() ? 6 : 4) * B * S * D * F;
  return static_cast<double>(c.num_layers) * (8 * B * S * D * D + 4 * B * S * S * D + ffn);
}

std::map<profile::Stage, double> stage_flops(const ModelConfig& c, index_t batch, index_t seq_len) {
  using profile::Stage;
  const double L = static_cast<double>(c.num_layers), N = static_cast<double>(batch * seq_len);
  const double D = static_cast<double>(c.d_model), F = static_cast<double>(c.ffn.d_ff);
  const double S = static_cast<double>(seq_len), B = static_cast<double>(batch);
  const double qkv = L * 6 * N * D * D, out = L * 2 * N * D * D, att = L * 4 * B * S * S * D;
  // the gate's product is timed with fc1's
  const double fc1 = L * 2 * N * D * F * (c.gated() ? 2 : 1), fc2 = L * 2 * N * F * D;
  return {{Stage::qkv_proj, qkv},         {Stage::out_proj, out},
          {Stage::attention, att},        {Stage::ffn_fc1, fc1},
          {Stage::ffn_fc2, fc2},          {Stage::bwd_qkv_proj, 2 * qkv},
          {Stage::bwd_out_proj, 2 * out}, {Stage::bwd_attention, 2 * att},
          {Stage::bwd_ffn_fc1, 2 * fc1},  {Stage::bwd_ffn_fc2, 2 * fc2}};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class Real>
Result measure(const Preset& p, int repeats, int warmup, std::optional<Precision> precision) {
  if (repeats < 1) throw ConfigError("repeats must be >= 1, got " + std::to_string(repeats));
  if (warmup < 0) throw ConfigError("warmup must be >= 0, got " + std::to_string(warmup));
  const Batch data = Batch::random(p.config, p.batch, p.seq_len, 1);
  const auto params = Params<Real>::init(p.config, 0);
  Activations<Real> acts, dacts;
  Params<Real> grads;
  Result r;
  using clock = std::chrono::steady_clock;
  const auto ms = [](clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  for (int rep = 0; rep < warmup + repeats; ++rep) {
    const bool timed = rep >= warmup;
    if (rep == warmup) profile::reset();
    profile::set_enabled(timed);
    const auto t0 = clock::now();
    forward(params, data, acts, {.precision = precision});
    const auto t1 = clock::now();
    backward(params, data, acts, grads, dacts, {.precision = precision});
    const auto t2 = clock::now();
    profile::set_enabled(false);
    if (timed) {
      r.fwd_ms.push_back(ms(t1 - t0));
      r.fwd_bwd_ms.push_back(ms(t2 - t0));
    }
  }
  r.stages = profile::timings();
  r.flops = forward_flops(p.config, p.batch, p.seq_len);
  return r;
}

namespace {

// The CPUs this process may run on, in order (none where that cannot be read: then nothing is
// pinned and the rule counts one core).
std::vector<int> usable_cpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
#endif
  return cpus;
}

// Pins the calling thread to one CPU; false where that is not possible.
bool pin_to(int cpu) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
#else
  (void)cpu;
  return false;
#endif
}

// One round of the probe: `threads` threads, thread t pinned to cpus[t % cpus.size()], released
// together, each running `iters` steps; seconds from the release to the last thread's end. The
// waits yield, so that a thread sharing a CPU with the one it waits for cannot hold it up.
template <class Real>
double probe_round(Real (*chains)(std::int64_t), std::int64_t iters, int threads,
                   const std::vector<int>& cpus, std::atomic<bool>& pinned) {
  using clock = std::chrono::steady_clock;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<clock::time_point> end(static_cast<std::size_t>(threads));
  std::vector<Real> sink(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      if (cpus.empty() || !pin_to(cpus[static_cast<std::size_t>(t) % cpus.size()])) pinned = false;
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      sink[static_cast<std::size_t>(t)] = chains(iters);
      end[static_cast<std::size_t>(t)] = clock::now();
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const auto start = clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  volatile Real keep = 0;
  for (Real v : sink) keep = keep + v;
  (void)keep;
  return std::chrono::duration<double>(*std::max_element(end.begin(), end.end()) - start).count();
}

}  // namespace

Peak assess_peak(const std::function<double(int)>& round, int threads, int cores, int rounds) {
  if (rounds < 1) throw ConfigError("rounds must be >= 1, got " + std::to_string(rounds));
  if (threads < 1 || cores < 1 || cores > threads)
    throw ConfigError("the peak needs 1 <= cores <= threads, got " + std::to_string(cores) +
                      " core(s) for " + std::to_string(threads) + " thread(s)");
  Peak best;
  for (int attempt = 1; attempt <= kPeakAttempts; ++attempt) {
    Peak p;
    p.threads = threads;
    p.cores = cores;
    p.rounds = rounds;
    p.attempts = attempt;
    std::vector<double> one, rates;
    for (int r = 0; r < rounds; ++r) one.push_back(round(1));
    p.one_thread_gflops = *std::max_element(one.begin(), one.end());
    if (threads == 1) {
      rates = one;
    } else {
      for (int r = 0; r < rounds; ++r) rates.push_back(round(threads));
    }
    p.gflops = *std::max_element(rates.begin(), rates.end());
    p.median_gflops = median(rates);
    p.min_gflops = *std::min_element(rates.begin(), rates.end());
    p.reliable = p.gflops >= kPeakScaling * cores * p.one_thread_gflops;
    if (p.reliable) return p;
    if (attempt == 1 || p.gflops > best.gflops) best = p;
    best.attempts = attempt;
  }
  return best;
}

std::optional<double> fraction_of_peak(double gflops, const Peak& peak) {
  if (!(peak.gflops > 0)) return std::nullopt;
  const double f = gflops / peak.gflops;
  if (!(f <= 1.0)) return std::nullopt;
  return f;
}

template <class Real>
Peak fma_peak(int rounds) {
  if (rounds < 1) throw ConfigError("rounds must be >= 1, got " + std::to_string(rounds));
  const simd::IsaKernels& k = detail::isa_kernels();
  const simd::VectorKernels<Real>& v = [&]() -> const simd::VectorKernels<Real>& {
    if constexpr (std::is_same_v<Real, float>)
      return k.svec;
    else
      return k.dvec;
  }();
  const int threads = num_threads();
  const std::vector<int> cpus = usable_cpus();
  const int cores = std::max(1, std::min(threads, static_cast<int>(cpus.size())));
  std::atomic<bool> pinned{true};
  // Calibrate to about 20 ms a round on one thread, then time the rounds.
  std::int64_t iters = std::int64_t{1} << 18;
  const double t = probe_round<Real>(v.fma_chains, iters, 1, cpus, pinned);
  iters = std::max<std::int64_t>(
      iters, static_cast<std::int64_t>(static_cast<double>(iters) * 0.02 / std::max(t, 1e-6)));
  const auto round = [&](int n) {
    const double flops = 2.0 * static_cast<double>(iters) * simd::kPeakChains * v.lanes * n;
    return flops / probe_round<Real>(v.fma_chains, iters, n, cpus, pinned) / 1e9;
  };
  Peak p = assess_peak(round, threads, cores, rounds);
  p.chains = simd::kPeakChains;
  p.lanes = v.lanes;
  p.isa = k.name;
  p.pinned = pinned.load();
  return p;
}

template Peak fma_peak<float>(int);
template Peak fma_peak<double>(int);

template Result measure<float>(const Preset&, int, int, std::optional<Precision>);
template Result measure<double>(const Preset&, int, int, std::optional<Precision>);

}  // namespace teo::bench
