#include "cli/bench.hpp"

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/backend.hpp"
#include "teo/model.hpp"
#include "teo/profile.hpp"

namespace teo::cli {

EncoderConfig bench_preset(const std::string& name, index_t& batch, index_t& seq_len) {
  EncoderConfig c;
  c.activation = Activation::gelu;
  c.norm_first = false;
  c.num_classes = 2;
  c.vocab_size = 30522;
  if (name == "bert-base") {
    c.d_model = 768;
    c.num_heads = 12;
    c.d_ff = 3072;
    c.num_layers = 2;
    batch = 8;
    seq_len = 128;
  } else if (name == "small") {
    c.d_model = 256;
    c.num_heads = 8;
    c.d_ff = 1024;
    c.num_layers = 4;
    batch = 32;
    seq_len = 64;
  } else {
    throw ConfigError("preset must be bert-base or small, got \"" + name + "\"");
  }
  c.max_len = seq_len;
  c.validate();
  return c;
}

double forward_flops(const EncoderConfig& c, index_t batch, index_t seq_len) {
  const double B = static_cast<double>(batch), S = static_cast<double>(seq_len);
  const double D = static_cast<double>(c.d_model), F = static_cast<double>(c.d_ff);
  return static_cast<double>(c.num_layers) *
         (8 * B * S * D * D + 4 * B * S * S * D + 4 * B * S * D * F);
}

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The GEMM FLOPs each timed stage performs per forward (backward stages do twice as many).
std::map<std::string, double> stage_flops(const EncoderConfig& c, index_t batch, index_t seq_len) {
  const double L = static_cast<double>(c.num_layers), N = static_cast<double>(batch * seq_len);
  const double D = static_cast<double>(c.d_model), F = static_cast<double>(c.d_ff);
  const double S = static_cast<double>(seq_len), B = static_cast<double>(batch);
  std::map<std::string, double> f{{"qkv_proj", L * 6 * N * D * D},
                                  {"out_proj", L * 2 * N * D * D},
                                  {"attention", L * 4 * B * S * S * D},
                                  {"ffn_fc1", L * 2 * N * D * F},
                                  {"ffn_fc2", L * 2 * N * F * D}};
  for (auto [name, v] : std::map<std::string, double>(f)) f["bwd." + name] = 2 * v;
  return f;
}

template <class Real>
int run(const BenchOptions& o, std::ostream& out) {
  index_t batch = 0, seq_len = 0;
  const EncoderConfig cfg = bench_preset(o.preset, batch, seq_len);
  const Batch data = Batch::random(cfg, batch, seq_len, 1);
  const auto params = Params<Real>::init(cfg, 0);
  Activations<Real> acts, dacts;
  Params<Real> grads;
  std::vector<double> fwd_ms, fwd_bwd_ms;
  using clock = std::chrono::steady_clock;
  for (int rep = 0; rep < o.warmup + o.repeats; ++rep) {
    const bool timed = rep >= o.warmup;
    if (rep == o.warmup) profile::reset();
    profile::set_enabled(timed);
    const auto t0 = clock::now();
    forward(params, data, acts);
    const auto t1 = clock::now();
    backward(params, data, acts, grads, dacts);
    const auto t2 = clock::now();
    profile::set_enabled(false);
    if (timed) {
      fwd_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      fwd_bwd_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
    }
  }
  const double flops = forward_flops(cfg, batch, seq_len);
  const double fwd = median(fwd_ms), fwd_bwd = median(fwd_bwd_ms);
  const double gflops_fwd = flops / (fwd * 1e6), gflops_fwd_bwd = 3 * flops / (fwd_bwd * 1e6);
  if (o.json) {
    out << nlohmann::json{{"preset", o.preset},
                          {"dtype", o.dtype},
                          {"threads", num_threads()},
                          {"backend", to_string(backend())},
                          {"isa", to_string(isa())},
                          {"fwd_ms", fwd},
                          {"fwd_bwd_ms", fwd_bwd},
                          {"gflops_fwd", gflops_fwd},
                          {"gflops_fwd_bwd", gflops_fwd_bwd},
                          {"repeats", o.repeats}}
               .dump()
        << "\n";
    return 0;
  }
  out << "teo bench: preset " << o.preset << ", " << o.dtype << ", backend " << to_string(backend())
      << ", isa " << to_string(isa()) << ", threads " << num_threads() << "\n  B=" << batch
      << " S=" << seq_len << " D=" << cfg.d_model << " H=" << cfg.num_heads << " F=" << cfg.d_ff
      << " layers=" << cfg.num_layers << " " << to_string(cfg.activation)
      << (cfg.norm_first ? " pre-norm" : " post-norm") << ", dropout 0; " << o.repeats
      << " timed runs after " << o.warmup << " warm-up\n\n";
  out << "  " << std::left << std::setw(20) << "stage" << std::right << std::setw(12) << "ms/run"
      << std::setw(10) << "share" << std::setw(12) << "GFLOP/s"
      << "\n";
  const auto sf = stage_flops(cfg, batch, seq_len);
  double total = 0;
  for (const auto& s : profile::stages()) total += s.seconds;
  for (const auto& s : profile::stages()) {
    const double ms = 1e3 * s.seconds / o.repeats;
    out << "  " << std::left << std::setw(20) << s.name << std::right << std::fixed
        << std::setprecision(2) << std::setw(12) << ms << std::setw(9) << std::setprecision(1)
        << 100 * s.seconds / total << "%";
    const auto it = sf.find(s.name);
    if (it != sf.end()) {
      out << std::setw(12) << std::setprecision(1) << it->second / (ms * 1e6);
    } else {
      out << std::setw(12) << "-";
    }
    out << "\n";
  }
  out << std::fixed << std::setprecision(2) << "\n  forward           median " << fwd
      << " ms  (min " << *std::min_element(fwd_ms.begin(), fwd_ms.end()) << ")  "
      << std::setprecision(1) << gflops_fwd << " GFLOP/s\n"
      << std::setprecision(2) << "  forward+backward  median " << fwd_bwd << " ms  (min "
      << *std::min_element(fwd_bwd_ms.begin(), fwd_bwd_ms.end()) << ")  " << std::setprecision(1)
      << gflops_fwd_bwd << " GFLOP/s\n"
      << "  FLOPs: forward " << std::setprecision(3) << flops / 1e9
      << " G (8BSD^2 + 4BS^2D + 4BSDF per layer); forward+backward 3x\n";
  return 0;
}

}  // namespace

int run_bench(const BenchOptions& o, std::ostream& out) {
  if (o.repeats < 1) throw ConfigError("--repeats must be >= 1, got " + std::to_string(o.repeats));
  if (o.warmup < 0) throw ConfigError("--warmup must be >= 0, got " + std::to_string(o.warmup));
  if (o.dtype == "float64") return run<double>(o, out);
  return run<float>(o, out);
}

}  // namespace teo::cli
